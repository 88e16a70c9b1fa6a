"""The tensor-parallel process group on torch.distributed: gloo on CPU, NCCL on CUDA.

One group per process (every rank of it is a TP rank). The layers hold their own rank and size
(`TPShard`), so a model built for one rank never asks this module who it is; this module only
joins, runs the collectives and leaves.

On CPU, ranks on one host sum through a shared-memory all-reduce (`_core.ShmAllReduce`: one
segment, one barrier per chunk) instead of gloo, whose TCP round trips dominate small messages;
gloo stays the fallback (ranks on several hosts, no /dev/shm, other dtypes) and the reference.
`PAGEDLLM_CPU_ALLREDUCE=gloo` forces gloo.

Rendezvous: rank 0's process owns it. `open_rendezvous` starts a torch.distributed `TCPStore` on a
port the OS picks and holds it from then on, so engines started side by side never race for a
port; the other ranks get its `(host, port)` and connect to it. Start-up (every rank reaching the
store: spawning, importing) is bounded by its own timeout; the group's timeout bounds each
collective once every rank is there.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from pagedllm._core import ShmAllReduce
from pagedllm.distributed.shm_names import remove_stale_segments

logger = logging.getLogger(__name__)

# the knob: "shm" (the default; used when every rank can map the segment) or "gloo"
CPU_ALLREDUCE_ENV = "PAGEDLLM_CPU_ALLREDUCE"
CPU_ALLREDUCE_CHOICES = ("shm", "gloo")
# a tensor crosses the segment in pieces of this size (the segment holds 2 x (ranks + 1) of them)
SHM_CHUNK_BYTES = 1 << 20

_shm: ShmAllReduce | None = None


class Rendezvous(NamedTuple):
    """Where the ranks meet: rank 0's store (another machine's ranks reach it at `host`)."""

    host: str
    port: int


# the store's key every rank adds itself to, and the one the last to arrive sets
_ARRIVED_KEY, _ALL_ARRIVED_KEY = "pagedllm/arrived", "pagedllm/all-arrived"


def open_rendezvous(world_size: int, startup_timeout_s: float, host: str = "127.0.0.1"):
    """Rank 0's store, listening on `host` at a port the OS picked (`store.port`), held until
    the store is dropped. `startup_timeout_s` bounds how long the ranks may take to arrive."""
    return dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=startup_timeout_s),
        wait_for_workers=False,
    )


def backend_for(device: torch.device) -> str:
    """The collectives' backend for ranks on `device`: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int,
    world_size: int,
    rendezvous: dist.Store | Rendezvous,
    *,
    device: torch.device,
    timeout_s: float,
    startup_timeout_s: float,
) -> None:
    """Join the group: rank 0 passes the store it opened (`open_rendezvous`), the others its
    `Rendezvous`. Blocks until every rank has arrived, for up to `startup_timeout_s`; then
    `timeout_s` bounds every collective: a rank that stops answering fails the others'
    collectives instead of hanging them."""
    global _shm
    backend = backend_for(device)
    choice = cpu_allreduce_choice()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
    store = rendezvous
    if isinstance(rendezvous, Rendezvous):
        store = dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=startup_timeout_s),
        )
    _wait_for_every_rank(store, world_size)
    if not dist.is_initialized():
        # torch names a group's store keys after the count of groups this process began, joins
        # that failed or are still pending included (an engine whose start failed); the other
        # ranks are fresh processes counting from zero, so this group counts from zero too
        dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if backend == "gloo" and world_size > 1 and choice == "shm":
        _shm = _join_shm_allreduce(rank, world_size, timeout_s)


def _wait_for_every_rank(store: dist.Store, world_size: int) -> None:
    """Return once every rank has reached the store (bounded by the store's start-up timeout):
    the group's own handshake then runs under the step timeout with nobody still starting."""
    if store.add(_ARRIVED_KEY, 1) == world_size:
        store.set(_ALL_ARRIVED_KEY, b"1")
    store.wait([_ALL_ARRIVED_KEY])


def cpu_allreduce_choice() -> str:
    """The CPU all-reduce asked for (`PAGEDLLM_CPU_ALLREDUCE`); ValueError for an unknown one."""
    value = os.environ.get(CPU_ALLREDUCE_ENV, "shm").strip().lower()
    if value not in CPU_ALLREDUCE_CHOICES:
        raise ValueError(
            f"{CPU_ALLREDUCE_ENV} must be one of {', '.join(CPU_ALLREDUCE_CHOICES)}, got {value!r}"
        )
    return value


def _join_shm_allreduce(rank: int, size: int, timeout_s: float) -> ShmAllReduce | None:
    """Rank 0 creates the segment and tells the others its name over gloo; every rank maps it,
    or none uses it (a rank on another host, /dev/shm refused). The name is unlinked as soon as
    every rank has it mapped, so nothing is left in /dev/shm even if a rank is killed later."""
    handle: ShmAllReduce | None = None
    failure: Exception | None = None
    name: list[str | None] = [None]
    if rank == 0:
        remove_stale_segments()  # what engines killed in this window before left
        try:
            handle = ShmAllReduce.create(size, SHM_CHUNK_BYTES, timeout_s)
            name[0] = handle.name
        except OSError as exc:
            failure = exc
    attached: list[bool | None] = [None] * size
    try:
        dist.broadcast_object_list(name, src=0)
        if rank != 0 and name[0] is not None:
            try:
                handle = ShmAllReduce.attach(name[0], rank, timeout_s)
            except (OSError, ValueError) as exc:
                failure = exc
        dist.all_gather_object(attached, handle is not None)
    finally:
        # every rank has mapped it, or the group failed (a rank died): the name goes either way
        if rank == 0 and handle is not None:
            handle.unlink()
    if all(attached):
        return handle
    if failure is not None:
        logger.warning("shared-memory all-reduce unavailable (%s); using gloo", failure)
    return None


def uses_shm_allreduce() -> bool:
    """Whether `all_reduce` goes through shared memory (else torch.distributed)."""
    return _shm is not None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the same result. The shared-memory
    path takes contiguous float32 / bfloat16 tensors (the same on every rank: the ranks run the
    same model), anything else goes through torch.distributed."""
    if _shm is not None and x.is_contiguous():
        if x.dtype == torch.float32:
            _shm.all_reduce_f32(x.detach().view(-1).numpy())
            return x
        if x.dtype == torch.bfloat16:
            _shm.all_reduce_bf16(x.detach().view(-1).view(torch.int16).numpy())
            return x
    dist.all_reduce(x)
    return x


def gather_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: the ranks' `x` concatenated along the last axis (in rank order); others: None.

    Through the shared-memory segment when it is in use: each rank puts its part in its columns
    of a zeroed whole and the whole is summed (adding zeros is exact), twice the bytes of a
    gather but no TCP round trip: gloo's gather of a step's logits costs more than all of its
    all-reduces together."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if _shm is not None and x.dtype in (torch.float32, torch.bfloat16):
        width = x.shape[-1]
        whole = x.new_zeros((*x.shape[:-1], width * size))
        whole[..., rank * width : (rank + 1) * width] = x
        all_reduce(whole)
        return whole if rank == 0 else None
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if rank == 0 else None


def abort() -> None:
    """This rank gives up (its step failed): the other ranks' shared-memory all-reduces fail at
    once instead of waiting for it until their timeout."""
    if _shm is not None:
        _shm.abort()


def destroy_tensor_parallel() -> None:
    global _shm
    _shm = None  # unmaps this rank's view of the segment (its name is gone already)
    if is_initialized():
        dist.destroy_process_group()
