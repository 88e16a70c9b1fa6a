"""Start-up sizing: the context length and how many KV-cache blocks the device and the host hold.

On CUDA the device block count is profiled (a forward over a full token budget, then what memory
is left goes to the cache); on the CPU it is a fixed budget (`cpu_kv_cache_space`). Either way a
cache that cannot hold one `max_model_len` sequence (under `prefill_first`, one of the token
budget, if shorter) is refused at start-up: whether it can is the core's admission rule
(`min_kv_blocks`: the sequence's blocks plus the watermark's share).

A model with sliding windows has hybrid KV groups (`attention/kv_groups.py`): a block holds one
group's layers, so the same bytes are more blocks, and a window group's share of a sequence is
bounded by its window and the prefill chunk (vLLM's rule), so the same blocks hold more
sequences.
"""

from __future__ import annotations

import logging
import math

import torch

from pagedllm._core import min_kv_blocks
from pagedllm.attention.kv_groups import KVGroupLayout
from pagedllm.attention.paged import AttentionMetadata
from pagedllm.config import EngineArgs, GiB
from pagedllm.distributed.layers import tp_kv_heads
from pagedllm.kernels.reference import kv_row_size, kv_storage_dtype
from pagedllm.models import ModelConfig
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.kv_layout import kv_layout

logger = logging.getLogger("pagedllm")


def resolve_max_model_len(args: EngineArgs, cfg: ModelConfig) -> int:
    if args.max_model_len is None:
        return cfg.max_position_embeddings
    if args.max_model_len > cfg.longest_context:
        # beyond the native length only as far as the RoPE scaling reaches
        raise ValueError(
            f"max_model_len={args.max_model_len} exceeds what the model's RoPE covers: "
            f"{cfg.longest_context} (config.json: max_position_embeddings="
            f"{cfg.max_position_embeddings}, rope_type {cfg.rope.rope_type!r}); a longer "
            f"context needs a rope_scaling (yarn, dynamic, linear, ...) that extends it"
        )
    return args.max_model_len


def available_host_memory() -> int | None:
    """Bytes the kernel reports as available for new allocations (None where unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_host_memory(cache_bytes: int, space_gib: float) -> None:
    # the cache is allocated zeroed (every page touched): refuse before the machine swaps
    available = available_host_memory()
    if available is not None and cache_bytes > available:
        raise ValueError(
            f"cpu_kv_cache_space={space_gib:g} GiB asks for a {cache_bytes / GiB:.2f} GiB KV "
            f"cache, but only {available / GiB:.2f} GiB of memory is available; lower "
            f"--cpu-kv-cache-space (or max_num_seqs / max_model_len)"
        )


class KVCachePlanner:
    """Sizes the KV cache of one engine: `plan()` gives (device blocks, host blocks)."""

    def __init__(
        self,
        args: EngineArgs,
        cfg: ModelConfig,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        max_num_batched_tokens: int,
        draft=None,
    ) -> None:
        self.args = args
        # the cache's layer groups (the workers' cache has the same: `worker/kv_layout.py`)
        self.kv_layout = kv_layout(args, cfg, max_model_len)
        self.cfg = cfg
        self.model = model
        self.dtype = dtype
        self.device = device
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        # speculative draft model: its cache has a block for each of the target's
        self.draft = draft

    def bytes_per_block(self) -> int:
        cfg = self.cfg
        # per rank: under tensor parallelism each rank's cache holds its KV heads
        target = CacheEngine.bytes_per_block(
            num_layers=self.kv_layout.layers_per_block,
            num_kv_heads=tp_kv_heads(cfg.num_kv_heads, self.args.tensor_parallel_size),
            head_dim=cfg.head_dim,
            block_size=self.args.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.args.kv_cache_dtype,
        )
        draft = self.draft.bytes_per_block(self.args.block_size) if self.draft else 0
        return target + draft

    def plan(self) -> tuple[int, int]:
        """Device and host block counts; fails if one max_model_len sequence cannot fit."""
        args = self.args
        block_bytes = self.bytes_per_block()
        # the core's admission rule: the fewest blocks the longest sequence the scheduler holds
        # is ever admitted into (its blocks plus the watermark's share)
        layout = self.kv_layout
        log_kv_layout(args, self.cfg, layout)
        hybrid = layout.is_hybrid
        least = min_kv_blocks(
            self.max_model_len,
            block_size=args.block_size,
            watermark=args.watermark,
            scheduling=args.scheduling,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_groups=list(layout.windows) if hybrid else None,
        )
        if args.num_gpu_blocks is not None:
            num_gpu_blocks = args.num_gpu_blocks
        elif self.device.type == "cuda":
            num_gpu_blocks = self.profile_gpu_blocks(block_bytes)
        else:
            # CPU: a fixed memory budget, no more than every sequence at full length needs
            full = self.blocks_per_seq() * args.max_num_seqs
            num_gpu_blocks = min(
                int(args.cpu_kv_cache_space * GiB) // block_bytes, max(full, least)
            )
            _check_host_memory(num_gpu_blocks * block_bytes, args.cpu_kv_cache_space)
        if num_gpu_blocks < least:
            raise ValueError(
                f"KV cache too small: one sequence of max_model_len={self.max_model_len} needs "
                f"{least} blocks of {args.block_size} tokens (with the watermark's "
                f"{args.watermark:g} of the cache kept free), but only {num_gpu_blocks} are "
                f"available; lower max_model_len or give more memory "
                f"(num_gpu_blocks / gpu_memory_utilization / cpu_kv_cache_space)"
            )
        num_cpu_blocks = int(args.swap_space * GiB) // block_bytes
        return num_gpu_blocks, num_cpu_blocks

    def blocks_per_seq(self) -> int:
        """The most blocks one `max_model_len` sequence holds, every KV group (a window
        group's bounded by its window and the prefill chunk)."""
        bs, layout = self.args.block_size, self.kv_layout
        if not layout.is_hybrid:
            return math.ceil(self.max_model_len / bs)
        # the core's rule (`kv::max_blocks_held`), without the watermark's share
        return min_kv_blocks(
            self.max_model_len,
            block_size=bs,
            watermark=0.0,
            scheduling=self.args.scheduling,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_groups=list(layout.windows),
        )

    @torch.inference_mode()
    def profile_gpu_blocks(self, block_bytes: int) -> int:
        """Run a forward of a full token budget, then give what memory is left to the cache."""
        args, cfg, device = self.args, self.cfg, self.device
        num_tokens = min(self.max_num_batched_tokens, self.max_model_len * args.max_num_seqs)
        seq_len = min(num_tokens, self.max_model_len)
        num_seqs = math.ceil(num_tokens / seq_len)
        bs = args.block_size
        blocks_per_seq = math.ceil(seq_len / bs)
        cache_dtype = kv_storage_dtype(args.kv_cache_dtype, self.dtype)
        row = kv_row_size(cfg.head_dim, cache_dtype)
        scratch = torch.zeros(
            (2, cfg.num_layers, num_seqs * blocks_per_seq, bs, cfg.num_kv_heads, row),
            dtype=cache_dtype,
            device=device,
        )
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_seqs * seq_len, device=device) % (scratch.shape[2] * bs),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * seq_len,
            seq_lens=lens,
            block_tables=torch.arange(
                num_seqs * blocks_per_seq, dtype=torch.int32, device=device
            ).view(num_seqs, blocks_per_seq),
            max_query_len=seq_len,
            max_seq_len=seq_len,
            is_decode_only=False,
        )
        ids = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=device)
        positions = torch.arange(seq_len, device=device).repeat(num_seqs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        hidden = self.model(ids, positions, scratch, meta)
        self.model.compute_logits(hidden[-args.max_num_seqs :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside_torch = total - free - torch.cuda.memory_reserved()
        budget = total * args.gpu_memory_utilization - peak - outside_torch
        return max(int(budget // block_bytes), 0)


def log_kv_layout(args: EngineArgs, cfg: ModelConfig, layout: KVGroupLayout) -> None:
    """The start-up log line of the cache's layer groups (or why a model with windows keeps
    every block of every layer)."""
    if layout.is_hybrid:
        logger.info("KV cache layer groups: %s", layout.describe())
    elif cfg.layer_windows and args.hybrid_kv_off_reason:
        logger.info(
            "KV cache: sliding-window layers keep every block (one group): %s",
            args.hybrid_kv_off_reason,
        )


def apply_kv_groups(scheduler, layout: KVGroupLayout) -> None:
    """Gives the scheduler the cache's layer groups (nothing to give for one full-attention
    group: its default)."""
    if layout.is_hybrid:
        scheduler.set_kv_groups(list(layout.windows))
