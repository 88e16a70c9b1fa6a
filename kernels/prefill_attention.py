"""Triton kernel: prefill / chunked-prefill attention over the paged KV cache.

The new tokens' K/V are already stored in the cache (store_kvcache runs first), so the kernel reads
the whole context — cached prefix (prefix-cache hit, earlier chunks, recompute after preemption)
and the new tokens alike — through the block table. Query i of a sequence with context length L
and query length q sits at position L - q + i and sees keys 0..L - q + i; with a sliding window W
only keys L - q + i - W + 1.. of those, and a query tile starts at its first row's window (the
blocks before it are never read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tile import attend_tile
from ._util import dot_precision, interpreting, next_pow2
from .reference import kv_code_max, kv_format, kv_row_size, unrotate


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    qsl_ptr,
    lens_ptr,
    bt_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): base-2 online softmax
    window,  # sliding window (used when HAS_WINDOW)
    softcap,  # score soft-capping in log2 units (used when CAP)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SCALE_AT: tl.constexpr,
    SCALE_RCP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,  # attend_tile's MASK past full_end: 2 causal, 3 with the window
    CAP: tl.constexpr,
):
    # grid (query tile, sequence, query head); tiles past a sequence's query length do no work
    tile = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    seq_len = tl.load(lens_ptr + s)
    ctx = seq_len - q_len  # tokens before this step's queries (cached prefix)

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    q_pos = ctx + m
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=mmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt

    active = tile * BLOCK_M < q_len
    # keys before the tile's first query position are visible to every row: no causal mask there
    full_end = tl.where(active, (ctx + tile * BLOCK_M) // BLOCK_N * BLOCK_N, 0)
    # the remaining keys up to the tile's last query position need the causal mask
    causal_end = tl.where(active, tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M), 0)
    if HAS_WINDOW:
        # from the first row's window on, every tile masked (causal and window)
        first = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = 0
        causal_start = tl.where(active, first, 0)
    else:
        causal_start = full_end
    for n0 in range(0, full_end, BLOCK_N):
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
            q_pos,
            seq_len,
            window,
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
            0,
            UPCAST,
            DOT_PREC,
            SCALE_AT,
            SCALE_RCP,
            CAP,
        )
    for n0 in range(causal_start, causal_end, BLOCK_N):
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
            q_pos,
            seq_len,
            window,
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
            CAUSAL_MASK,
            UPCAST,
            DOT_PREC,
            SCALE_AT,
            SCALE_RCP,
            CAP,
        )

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mmask[:, None] & dmask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q `[T, H, D]` packed by `query_start_loc` [S+1] -> `[T, H, D]`; causal within the new tokens.

    Rows past `query_start_loc[-1]` are left zero. `block_m` / `block_n` override tiles (tests).
    `sliding_window` W > 0: each query sees its last W keys only; `softcap` > 0: scores capped
    as `softcap * tanh(score / softcap)`.
    """
    T, H, D = q.shape
    S = seq_lens.numel()
    _, page, kvh, row = k_cache.shape
    quantized = kv_format(k_cache.dtype) != "auto"
    assert row == kv_row_size(D, k_cache.dtype), "cache rows do not match q's head size"
    if quantized:
        # the cache's rows are rotated: q meets them rotated (`reference.unrotate`), and the
        # output is rotated back below
        q = unrotate(q.float()).to(q.dtype)
    out = torch.zeros_like(q)  # zeros: padding rows past query_start_loc[-1] are never written
    if T == 0 or S == 0 or max_query_len <= 0:
        return out
    assert H % kvh == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert page & (page - 1) == 0, "block_size must be a power of two"
    block_d = next_pow2(D)
    # 64x64 tiles (128 query rows at D=128 with 8 warps) are the usual flash-attention sweet spot on
    # sm80/sm90; short chunks shrink BLOCK_M so that a 1..15-token chunk does not waste a 64-row
    # tile
    default_m = 128 if D >= 128 else 64
    block_m = block_m or min(default_m, max(16, next_pow2(max_query_len)))
    block_n = block_n or 64
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    grid = (triton.cdiv(int(max_query_len), block_m), S, H)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        out,
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
        GROUP=H // kvh,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=interpreting(),
        DOT_PREC=dot_precision(q.dtype if quantized else k_cache.dtype),
        # a quantized cache: each row's scale byte after its D codes
        SCALE_AT=D if quantized else 0,
        SCALE_RCP=1.0 / kv_code_max(k_cache.dtype) if quantized else 0.0,
        HAS_WINDOW=sliding_window > 0,
        CAUSAL_MASK=3 if sliding_window > 0 else 2,
        CAP=softcap > 0,
        num_warps=num_warps,
        num_stages=2,
    )
    return unrotate(out.float()).to(out.dtype) if quantized else out
