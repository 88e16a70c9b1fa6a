"""Paged attention entry point used by the models (docs/ARCHITECTURE.md §6).

`paged_attention` stores this step's K/V into the paged cache and attends. CUDA tensors go to the
Triton kernels (triton is imported only then, so this module imports on machines without it);
float32 and bfloat16 CPU tensors to the Rust kernels (`cpu_attention.py`), which read the cache
in place; anything else (float16 on the CPU) to the vectorized torch reference.

A layer's `LayerAttention` adds what differs between layers: a sliding window W (the query at
position p sees keys p - W + 1..p, as `transformers` masks them; every path skips the blocks
wholly before the window) and Gemma 2's score soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from pagedllm.attention import cpu_attention
from pagedllm.kernels import reference as _ref

__all__ = ["AttentionMetadata", "LayerAttention", "LayerGroups", "paged_attention"]


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention does with its scores: the softmax `scale`, a sliding
    `window` (0: none; a window at least the context's length is full attention) and the
    logit `softcap` (0: none; `softcap * tanh(score / softcap)`)."""

    scale: float
    window: int = 0
    softcap: float = 0.0


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # int64 [T]; -1 = padding, not stored
    query_start_loc: Tensor  # int32 [S+1]
    seq_lens: Tensor  # int32 [S]  context length including this step's tokens
    block_tables: Tensor  # int32 [S, W]
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool  # every query length is 1
    # Split-KV count for the CUDA decode kernel. None: derived from the batch size and the block
    # table width W * block_size, so a CUDA graph captured with W = max_model_len / block_size keeps
    # one fixed grid. Ignored on CPU.
    num_splits: int | None = None
    # Hybrid KV groups (`attention/kv_groups.py`): each layer's cache slot and its group's
    # metadata (the group's slot_mapping and block_tables); None: every layer reads this one
    # at its own index of the cache's layer axis.
    layer_groups: LayerGroups | None = None
    # CPU path: the step's attention plan (gather/scatter indices, masks), built by the first layer
    # and reused by the others. Keyed by what it depends on besides the fields above; it is rebuilt
    # when one of those fields is reassigned (not when a tensor is mutated in place).
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # CPU kernels: the fields above as numpy arrays, converted by the first layer (same rule)
    _arrays: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def for_layer(self, layer: int) -> tuple[int, AttentionMetadata]:
        """Layer `layer`'s index into the cache's layer axis and the metadata it attends
        with."""
        groups = self.layer_groups
        if groups is None:
            return layer, self
        return groups.slot[layer], groups.metas[groups.group[layer]]

    def cpu_arrays(self) -> tuple:
        inputs = (self.slot_mapping, self.query_start_loc, self.seq_lens, self.block_tables)
        hit = self._arrays
        if hit is not None and all(a is b for a, b in zip(hit[0], inputs)):
            return hit[1]
        arrays = cpu_attention.step_arrays(self)
        self._arrays = (inputs, arrays)
        return arrays

    def cpu_plan(
        self, block_size: int, num_heads: int, num_tokens: int, device, window: int = 0
    ) -> _ref.AttentionPlan:
        key = (block_size, num_heads, num_tokens, device, window)
        inputs = (self.slot_mapping, self.query_start_loc, self.seq_lens, self.block_tables)
        hit = self._plans.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], inputs)):
            return hit[1]
        plan = _ref.build_plan(
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            block_size,
            num_heads,
            num_tokens,
            device,
            window,
        )
        self._plans[key] = (inputs, plan)
        return plan


@dataclass(frozen=True)
class LayerGroups:
    """A step's hybrid KV groups: each layer's `slot` in a cache block and `group`, and each
    group's metadata `metas` (its own slot_mapping and block tables, the rest the step's)."""

    slot: tuple[int, ...]
    group: tuple[int, ...]
    metas: tuple[AttentionMetadata, ...]


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float | LayerAttention,
    key_feedback: Tensor | None = None,
) -> Tensor:
    """q `[T, H, D]`, k/v `[T, KVH, D]`; caches `[num_blocks, block_size, KVH, D]` (quantized:
    `D + 1`, `kernels.reference`) -> `[T, H, D]`. `scale`: the softmax scale of a full-attention
    layer, or the layer's `LayerAttention`. `key_feedback`: a quantized cache's keys coded by
    error feedback (`attention/key_transform.py`)."""
    layer = _as_layer(scale)
    if q.is_cuda:
        return _paged_attention_triton(q, k, v, k_cache, v_cache, meta, layer, key_feedback)
    if cpu_attention.supports(q, k_cache):
        arrays, capped = meta.cpu_arrays(), (layer.scale, layer.window, layer.softcap)
        return cpu_attention.store_and_attend(
            q, k, v, k_cache, v_cache, arrays, *capped, key_feedback
        )
    return _paged_attention_torch(q, k, v, k_cache, v_cache, meta, layer, key_feedback)


def _paged_attention_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta,
    scale: float | LayerAttention,
    key_feedback: Tensor | None = None,
) -> Tensor:
    """The torch reference path: one vectorized gather + SDPA for decode, prefill and mixed
    batches (the plan groups decode rows itself)."""
    layer = _as_layer(scale)
    plan = meta.cpu_plan(k_cache.shape[1], q.shape[1], q.shape[0], q.device, layer.window)
    _ref.store_planned(k, v, k_cache, v_cache, plan, key_feedback)
    return _ref.attend(q, k_cache, v_cache, plan, layer.scale, layer.softcap)


def _as_layer(scale: float | LayerAttention) -> LayerAttention:
    return scale if isinstance(scale, LayerAttention) else LayerAttention(scale)


def _paged_attention_triton(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float | LayerAttention,
    key_feedback: Tensor | None = None,
) -> Tensor:
    from pagedllm.kernels import decode_attention, prefill_attention, store_kv

    layer = _as_layer(scale)
    scale, window, softcap = layer.scale, layer.window, layer.softcap

    store_kv.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, key_feedback)
    if meta.is_decode_only:
        num_splits = meta.num_splits
        if num_splits is None:
            num_splits = decode_attention.choose_num_splits(
                q.shape[0],
                k_cache.shape[2],
                meta.block_tables.shape[1] * k_cache.shape[1],
                q.device,
            )
        return decode_attention.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            num_splits,
            sliding_window=window,
            softcap=softcap,
        )
    return prefill_attention.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        meta.max_query_len,
        sliding_window=window,
        softcap=softcap,
    )
