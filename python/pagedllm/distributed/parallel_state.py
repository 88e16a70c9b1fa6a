"""The tensor-parallel process group on torch.distributed: gloo on CPU, NCCL on CUDA.

One group per process (every rank of it is a TP rank). The layers hold their own rank and size
(`TPShard`), so a model built for one rank never asks this module who it is; this module only
joins, runs the collectives and leaves.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_init_method(host: str = "127.0.0.1") -> str:
    """A `tcp://` rendezvous address on this machine's `host` address (another machine's ranks
    reach it there) with a port that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def backend_for(device: torch.device) -> str:
    """The collectives' backend for ranks on `device`: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, *, device: torch.device, timeout_s: float
) -> None:
    """Join the group (blocks until every rank has joined). `timeout_s` bounds every collective:
    a rank that stops answering fails the others' collectives instead of hanging them."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    if not dist.is_initialized():
        # torch names a group's store keys after the count of groups this process began, joins
        # that failed or are still pending included (an engine whose start failed); the other
        # ranks are fresh processes counting from zero, so this group counts from zero too
        dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the same result."""
    dist.all_reduce(x)
    return x


def gather_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: the ranks' `x` concatenated along the last axis (in rank order); others: None."""
    rank, size = dist.get_rank(), dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if rank == 0 else None


def destroy_tensor_parallel() -> None:
    if is_initialized():
        dist.destroy_process_group()
