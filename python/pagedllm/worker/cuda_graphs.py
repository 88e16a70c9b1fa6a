"""CUDA graphs for decode-only steps (docs/ARCHITECTURE.md §6f).

A decode step launches hundreds of small kernels whose launch cost outweighs their work at small
batches. At start-up the model's forward is captured once per batch-size bucket (1, 2, 4, 8, then
every 16 up to `max_num_seqs`) over persistent input buffers; a decode-only step copies its inputs
into those buffers, padded up to its bucket, and replays that bucket's graph.

Padding rows are inert: their KV slot is -1 (the store kernel skips it) and their context length
0 (the decode kernel writes zeros for them, reading no block). The block-table buffer has the
width of `max_model_len`, so the decode kernel's split count, which depends on that width, is
the same at capture and at replay. The attention metadata of every bucket is built once over
views of the buffers: the graph reads whatever the buffers hold at replay.

Graphs are off with `enforce_eager=True`, on the CPU, and with LoRA (its per-step adapter
segments are not in the buffers).
"""

from __future__ import annotations

import logging
import time

import torch

from pagedllm.attention.paged import AttentionMetadata

logger = logging.getLogger(__name__)

# batch sizes below 16 each get a bucket of their own power of two; above, every 16 (nano-vllm's
# and vLLM's choice: a padded row costs little next to a graph per batch size)
_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 16


def decode_graphs_enabled(device: torch.device, *, enforce_eager: bool, lora: bool) -> bool:
    """Whether the engine captures decode CUDA graphs: CUDA, not `enforce_eager`, no LoRA."""
    return device.type == "cuda" and not enforce_eager and not lora


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 32, ... up to and always including
    `max_num_seqs`."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in _SMALL_BUCKETS if b < max_num_seqs]
    sizes += range(_BUCKET_STEP, max_num_seqs, _BUCKET_STEP)
    return [*sizes, max_num_seqs]


def bucket_for(buckets: list[int], num_seqs: int) -> int | None:
    """The smallest bucket that holds `num_seqs` rows (None: larger than every bucket)."""
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


class DecodeBuffers:
    """The persistent inputs of the captured graphs, for up to `max_batch` sequences whose
    block tables are at most `max_blocks` wide, and the copy of a step's inputs into them."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=i32, device=device)
        # one query token per row: constant
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)

    def meta(self, batch: int, max_seq_len: int) -> AttentionMetadata:
        """Decode metadata over the first `batch` rows of the buffers (views: a graph captured
        with it reads the buffers' contents at replay)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=max_seq_len,
            is_decode_only=True,
        )

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether a step is a decode-only step these buffers hold."""
        return (
            meta.is_decode_only
            and 0 < num_tokens <= self.max_batch
            and meta.seq_lens.shape[0] == num_tokens
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int
    ) -> None:
        """Copy a decode step of n rows into the buffers and make rows n..batch padding. The
        padding is rewritten every step: rows left from a larger earlier step would otherwise
        store their K/V into slots that may belong to live sequences now."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # columns past the step's width keep earlier (valid) block ids; the kernel reads only
        # the blocks below each row's context length
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(
            meta.block_tables, non_blocking=True
        )
        if batch > n:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].zero_()


class DecodeCudaGraphs:
    """The captured decode graphs of one model over one KV cache. `capture()` at start-up;
    then `can_run` / `run` per step (ModelRunner.forward asks)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_num_seqs)
        self.buffers = DecodeBuffers(
            self.buckets[-1], -(-max_model_len // block_size), kv_cache.device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @torch.inference_mode()
    def capture(self) -> DecodeCudaGraphs:
        """Capture every bucket, largest first, in one memory pool (a smaller bucket's
        intermediates fit in the larger one's). Each is run eagerly once first, so Triton
        compiles and cuBLAS sets up outside the capture."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        buf, pool = self.buffers, None
        # capture with every row padding: nothing is stored, no block is read
        buf.slot_mapping.fill_(-1)
        buf.seq_lens.zero_()
        for batch in reversed(self.buckets):
            meta = buf.meta(batch, self.max_model_len)
            args = (buf.input_ids[:batch], buf.positions[:batch], self.kv_cache, meta)
            self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine's helper threads (bitmask fill, KV copies) may touch CUDA
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[batch] = self.model(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.2f s, %.1f MiB",
            len(self.graphs),
            self.buckets[-1],
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )
        return self

    def stats(self) -> dict:
        return {
            "capture_s": round(self.capture_seconds, 3),
            "capture_MiB": round(self.capture_bytes / 2**20, 1),
            "buckets": len(self.graphs),
        }

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        return self.buffers.fits(input_ids.shape[0], meta)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states `[n, E]` of a decode step (a view of the graph's output buffer, valid
        until the next replay)."""
        n = input_ids.shape[0]
        batch = bucket_for(self.buckets, n)
        self.buffers.load(input_ids, positions, meta, batch)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
