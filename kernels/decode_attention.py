"""Triton kernels: paged decode attention with split-KV (flash-decoding) and GQA.

Launch shape is `(S, KVH, num_splits)` for the split kernel and `(S, H)` for the reduce, so it
depends only on the batch size and `num_splits` (fixed per max context), never on the current
sequence lengths: a decode step can be captured once in a CUDA graph and replayed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._tile import attend_tile
from ._util import dot_precision, interpreting, next_pow2
from .reference import kv_code_max, kv_format, kv_row_size, unrotate

# Each split covers at least this many tokens: shorter splits spend more on the reduce and on the
# per-split q load than they win in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int, device=None) -> int:
    """Split-KV count for a decode launch: enough programs to fill the GPU about twice, but no
    split shorter than _MIN_TOKENS_PER_SPLIT tokens of `max_context_len` (e.g. max_model_len).

    Depends only on static quantities (batch bucket, model shape, max context), so the grid stays
    fixed across steps.
    """
    by_len = max(1, -(-int(max_context_len) // _MIN_TOKENS_PER_SPLIT))
    if device is not None and torch.device(device).type == "cuda":
        dev = torch.device(device)
        sms = _num_sms(dev.index if dev.index is not None else torch.cuda.current_device())
    else:
        sms = 132
    by_occupancy = max(1, -(-2 * sms // max(1, batch_size * num_kv_heads)))
    return int(min(_MAX_SPLITS, by_len, by_occupancy))


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is a single MUFU op)
    window,  # sliding window (0: none): the query sees the last `window` keys only
    softcap,  # score soft-capping in log2 units (used when CAP)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SCALE_AT: tl.constexpr,
    SCALE_RCP: tl.constexpr,
    CAP: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + s)
    # a sliding window: keys `first..seq_len` only (blocks before `first` are never read)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # every sequence divides its own (windowed) keys into NUM_SPLITS tile-aligned ranges;
    # trailing splits of a short sequence are empty and just report lse = -inf
    split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # all GROUP query heads of this kv head in one tile (padded to >= 16 rows for tl.dot), so each
    # K/V tile is read from memory once per kv head, not once per query head
    hh = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + hh
    hmask = hh < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    s64 = s.to(tl.int64)
    q = tl.load(
        q_ptr + s64 * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + s64 * stride_bt
    for n0 in range(start, end, BLOCK_N):
        # keys past `end` are masked; no causal mask: the single query sees its whole range
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            kc_ptr,
            vc_ptr,
            bt_row,
            kvh,
            hh,
            end,
            0,
            softcap,
            d,
            dmask,
            qk_scale,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            PAGE,
            BLOCK_N,
            1,
            UPCAST,
            DOT_PREC,
            SCALE_AT,
            SCALE_RCP,
            CAP,
        )

    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]  # empty range (seq_len 0 padding) -> zeros
    omask = hmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + s64 * stride_os + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=omask,
        )
    else:
        # mid buffers are contiguous [S, H, NUM_SPLITS, HEAD_DIM] / [S, H, NUM_SPLITS], fp32
        row = (s64 * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=omask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=hmask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # merge the per-split softmax partials of one (sequence, head): weights 2^(lse_j - max lse)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_S)
    jmask = j < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    row = (s * NUM_HEADS + h) * NUM_SPLITS + j
    lse = tl.load(mid_lse_ptr + row, mask=jmask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): all weights 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(
        mid_o_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=jmask[:, None] & dmask[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + s * stride_os + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=dmask
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    *,
    block_n: int | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q `[S, H, D]` (one token per sequence) over the paged context -> `[S, H, D]`.

    Rows with seq_len 0 (CUDA-graph padding) give zeros. `block_n` overrides the KV tile (tests).
    `sliding_window` W > 0: each query sees its last W keys only; `softcap` > 0: scores capped
    as `softcap * tanh(score / softcap)`.
    """
    S, H, D = q.shape
    _, page, kvh, row = k_cache.shape
    quantized = kv_format(k_cache.dtype) != "auto"
    assert row == kv_row_size(D, k_cache.dtype), "cache rows do not match q's head size"
    if quantized:
        # the cache's rows are rotated: q meets them rotated (`reference.unrotate`), and the
        # output is rotated back below
        q = unrotate(q.float()).to(q.dtype)
    out = torch.empty_like(q)
    if S == 0:
        return out
    assert H % kvh == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert page & (page - 1) == 0, "block_size must be a power of two"
    group = H // kvh
    num_splits = max(1, int(num_splits))
    block_d = next_pow2(D)
    # 64 tokens x D per K/V tile: 16 KiB each at D=128 bf16, enough bytes in flight per program
    # while registers stay well below spilling with 4 warps
    block_n = block_n or 64
    block_h = max(16, next_pow2(group))  # tl.dot needs M >= 16
    if num_splits > 1:
        mid_o = torch.empty(S, H, num_splits, D, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(S, H, num_splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused: the split kernel writes the output directly
    _decode_split_kernel[(S, kvh, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        mid_o,
        mid_lse,
        float(scale) * 1.4426950408889634,
        int(sliding_window),
        float(softcap) * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=H,
        NUM_SPLITS=num_splits,
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_N=block_n,
        UPCAST=interpreting(),
        DOT_PREC=dot_precision(q.dtype if quantized else k_cache.dtype),
        # a quantized cache: each row's scale byte after its D codes
        SCALE_AT=D if quantized else 0,
        SCALE_RCP=1.0 / kv_code_max(k_cache.dtype) if quantized else 0.0,
        CAP=softcap > 0,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(S, H)](
            mid_o,
            mid_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=H,
            NUM_SPLITS=num_splits,
            BLOCK_S=next_pow2(num_splits),
            HEAD_DIM=D,
            BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2,
        )
    return unrotate(out.float()).to(out.dtype) if quantized else out
