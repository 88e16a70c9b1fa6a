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


# Bounds on the CPU path's temporaries: queries of one sequence are processed in chunks of at most
# _Q_CHUNK rows, and padded sub-batches hold at most _SCORE_BUDGET fp32 scores (64 MiB), so that a
# long prompt mixed with many decodes does not pad every decode row to the prompt's length.
_Q_CHUNK = 128
_SCORE_BUDGET = 1 << 24


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
) -> Tensor:
    """Attention of every query token over its sequence's paged context.

    q `[T, H, D]`; sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]` (length q_s)
    and has context length `seq_lens[s]` = L_s (its new tokens included, already stored in the
    cache). Query i of s sits at position L_s - q_s + i and sees keys 0..that position.
    Rows beyond `query_start_loc[-1]` and queries without any visible key get zeros.
    Math in float32; result in q.dtype.
    """
    out = torch.zeros_like(q)
    S = seq_lens.numel()
    if S == 0 or q.shape[0] == 0:
        return out
    dev = q.device
    qsl = query_start_loc.to(dev, torch.long)
    lens = seq_lens.to(dev, torch.long)
    q_lens = qsl[1:] - qsl[:-1]

    # Split each sequence's queries into chunks [a, b) of <= _Q_CHUNK rows. A chunk behaves exactly
    # like a sequence of context L - q + b with b - a queries (same causal positions, fewer keys).
    n_chunks = (q_lens + _Q_CHUNK - 1) // _Q_CHUNK
    owner = torch.repeat_interleave(torch.arange(S, device=dev), n_chunks)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    a = (torch.arange(owner.numel(), device=dev) - first[owner]) * _Q_CHUNK
    b = torch.minimum(a + _Q_CHUNK, q_lens[owner])
    c_start, c_qlen, c_len = qsl[owner] + a, b - a, lens[owner] - q_lens[owner] + b

    H = q.shape[1]
    # decode-like chunks (1 query) and longer chunks are padded separately
    for group in (c_qlen == 1, c_qlen > 1):
        idx = group.nonzero().view(-1)
        if idx.numel() == 0:
            continue
        max_q = int(c_qlen[idx].max())
        max_n = max(1, int(c_len[idx].max()))
        per = max(1, _SCORE_BUDGET // (max_q * max_n * H))
        for i in range(0, idx.numel(), per):
            sub = idx[i:i + per]
            _attend_padded(q, k_cache, v_cache, block_tables[owner[sub]], c_start[sub], c_qlen[sub], c_len[sub],
                           scale, max_q, out)
    return out


def _attend_padded(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, q_start: Tensor,
                   q_lens: Tensor, lens: Tensor, scale: float, max_q: int, out: Tensor) -> None:
    """One padded batch: sequence s has queries q[q_start[s] : q_start[s] + q_lens[s]] and context lens[s]."""
    dev = q.device
    S = lens.numel()
    _, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    G = H // KVH
    max_n = max(1, int(lens.max()))

    # gather each sequence's context into a padded [S, N, KVH, D] through its block table
    nblk = min(-(-max_n // bs), tables.shape[1])
    bt = tables[:, :nblk].to(dev, torch.long)
    keys = k_cache[bt].reshape(S, nblk * bs, KVH, D)[:, :max_n].float()
    vals = v_cache[bt].reshape(S, nblk * bs, KVH, D)[:, :max_n].float()
    max_n = keys.shape[1]

    # scatter the packed queries into a padded [S, max_q, H, D]
    seq_idx = torch.repeat_interleave(torch.arange(S, device=dev), q_lens)
    local = torch.arange(seq_idx.numel(), device=dev) - (torch.cumsum(q_lens, 0) - q_lens)[seq_idx]
    rows = q_start[seq_idx] + local
    qp = q.new_zeros(S, max_q, H, D, dtype=torch.float32)
    qp[seq_idx, local] = q[rows].float()

    # GQA without materializing repeated K/V: the G query heads of a kv head share one matmul
    qg = qp.view(S, max_q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(S, KVH, G * max_q, D)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [S, KVH, G*max_q, N]
    scores = scores.view(S, KVH, G, max_q, max_n)

    # causal: query i of s sits at L_s - q_s + i; keys past it (and past L_s) are masked
    q_pos = (lens - q_lens)[:, None] + torch.arange(max_q, device=dev)[None, :]  # [S, max_q]
    key_pos = torch.arange(max_n, device=dev)
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    # explicit softmax so that rows without a visible key give 0 instead of NaN
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    o = torch.matmul(p.view(S, KVH, G * max_q, max_n), vals.permute(0, 2, 1, 3))  # [S, KVH, G*max_q, D]
    o = o.view(S, KVH, G, max_q, D).permute(0, 3, 1, 2, 4).reshape(S, max_q, H, D)
    out[rows] = o[seq_idx, local].to(out.dtype)


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
    return paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale)


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
    """Prefill / chunk attention over the paged cache, causal within the new tokens.

    `max_query_len` only shapes the Triton launch; the reference derives what it needs.
    """
    del max_query_len
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy-on-write: `kv_cache[:, :, dst] = kv_cache[:, :, src]` for every (src, dst) row, all layers."""
    if block_mapping.numel() == 0:
        return
    bm = block_mapping.to(kv_cache.device, torch.long)
    # advanced indexing reads every source before writing (sources and destinations are disjoint)
    kv_cache[:, :, bm[:, 1]] = kv_cache[:, :, bm[:, 0]]
