"""Pure-torch references for the paged-KV kernels.

These are the test oracles of the Triton kernels *and* the CPU execution path of the engine,
so they are vectorized (gather + padding, no per-token Python loops) and must not import triton.
Layout (docs/ARCHITECTURE.md §3): k_cache / v_cache are `[num_blocks, block_size, kv_heads, head_dim]`,
`kv_cache` is `[2, layers, num_blocks, block_size, kv_heads, head_dim]`; slot = block * block_size + offset.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "store_kvcache",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
]


def store_kvcache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k/v `[T, KVH, D]` into their slots; slot -1 marks padding and is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # flatten (block, offset) into one slot axis; the caches are views of one contiguous tensor
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = k[keep].to(k_cache.dtype)
    v_flat[slots] = v[keep].to(v_cache.dtype)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> Tensor:
    """Attention of every query token over its sequence's paged context.

    q `[T, H, D]`; sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]` (length q_s)
    and has context length `seq_lens[s]` = L_s (its new tokens included, already stored in the
    cache). Query i of s sits at position L_s - q_s + i and sees keys 0..that position.
    Rows beyond `query_start_loc[-1]` and queries without any visible key get zeros.
    Math in float32; result in q.dtype.
    """
    T, H, D = q.shape
    S = seq_lens.numel()
    out = torch.zeros_like(q)
    if S == 0 or T == 0:
        return out
    dev = q.device
    _, bs, KVH, _ = k_cache.shape
    G = H // KVH
    qsl = query_start_loc.to(dev, torch.long)
    lens = seq_lens.to(dev, torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    n_real = int(qsl[-1])
    max_q = int(max_query_len) if max_query_len is not None else int(q_lens.max())
    max_n = int(max_seq_len) if max_seq_len is not None else int(lens.max())
    max_q, max_n = max(max_q, 1), max(max_n, 1)

    # gather each sequence's context into a padded [S, N, KVH, D] through its block table
    nblk = min(-(-max_n // bs), block_tables.shape[1])
    bt = block_tables[:, :nblk].to(dev, torch.long)
    keys = k_cache[bt].reshape(S, nblk * bs, KVH, D)[:, :max_n].float()
    vals = v_cache[bt].reshape(S, nblk * bs, KVH, D)[:, :max_n].float()
    max_n = keys.shape[1]

    # scatter the packed queries into a padded [S, max_q, H, D]
    seq_idx = torch.repeat_interleave(torch.arange(S, device=dev), q_lens)
    local = torch.arange(n_real, device=dev) - qsl[seq_idx]
    qp = q.new_zeros(S, max_q, H, D, dtype=torch.float32)
    qp[seq_idx, local] = q[:n_real].float()

    # GQA without materializing repeated K/V: the G query heads of a kv head share one matmul
    qg = qp.view(S, max_q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(S, KVH, G * max_q, D)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [S, KVH, G*max_q, N]
    scores = scores.view(S, KVH, G, max_q, max_n)

    # causal: query i of s sits at L_s - q_s + i; keys past it (and past L_s) are masked
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [S, max_q]
    key_pos = torch.arange(max_n, device=dev)
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    visible = visible[:, None, None]  # [S, 1, 1, max_q, N]
    scores = scores.masked_fill(~visible, float("-inf"))
    # explicit softmax so that rows without a visible key give 0 instead of NaN
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    o = torch.matmul(p.view(S, KVH, G * max_q, max_n), vals.permute(0, 2, 1, 3))  # [S, KVH, G*max_q, D]
    o = o.view(S, KVH, G, max_q, D).permute(0, 3, 1, 2, 4).reshape(S, max_q, H, D)
    out[:n_real] = o[seq_idx, local].to(q.dtype)
    return out


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    num_splits: int = 1,
) -> Tensor:
    """One query token per sequence (q `[S, H, D]`) over its whole context; seq_len 0 -> zeros.

    `num_splits` only shapes the Triton launch; the result does not depend on it.
    """
    del num_splits
    S = q.shape[0]
    qsl = torch.arange(S + 1, device=q.device, dtype=torch.long)
    return paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale, max_query_len=1)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int,
) -> Tensor:
    """Prefill / chunk attention over the paged cache, causal within the new tokens."""
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                           max_query_len=max_query_len)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy-on-write: `kv_cache[:, :, dst] = kv_cache[:, :, src]` for every (src, dst) row, all layers."""
    if block_mapping.numel() == 0:
        return
    bm = block_mapping.to(kv_cache.device, torch.long)
    # advanced indexing reads every source before writing (sources and destinations are disjoint)
    kv_cache[:, :, bm[:, 1]] = kv_cache[:, :, bm[:, 0]]
