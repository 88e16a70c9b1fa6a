"""The online-softmax step over one tile of paged keys, shared by the decode and prefill kernels.

A quantized cache (`kv_cache_dtype` int8 / fp8, `SCALE_AT` = head_dim): each row's codes are
widened to q's dtype (exact: int8 and fp8 values fit bf16 / fp16 / fp32) and its scale (the byte
at `SCALE_AT` past the row's start codes the row's bound, `reference.quantize_rows`; the scale is
the bound times `SCALE_RCP`) multiplies the row's scores (keys) and probabilities (values), never
each element. The rows are rotated: the callers rotate q and the output (`reference.unrotate`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
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
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SCALE_AT: tl.constexpr = 0,
    SCALE_RCP: tl.constexpr = 0.0,
    CAP: tl.constexpr = False,
):
    # one online-softmax step over keys n0 .. n0 + BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < seq_len
    if MASK == 3:
        # nor read keys before the earliest window of the rows (their blocks may be freed)
        nmask = nmask & (n > tl.min(q_pos, 0) - window)
    blk = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
    tok = n % PAGE
    k_row = kc_ptr + blk * stride_kb + tok * stride_kt + kvh * stride_kh
    v_row = vc_ptr + blk * stride_vb + tok * stride_vt + kvh * stride_vh
    k = tl.load(k_row[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    v = tl.load(v_row[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    if SCALE_AT > 0:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        k_scale = _row_scale(k_row + SCALE_AT, nmask, SCALE_RCP)
        v_scale = _row_scale(v_row + SCALE_AT, nmask, SCALE_RCP)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if SCALE_AT > 0:
        qk = qk * k_scale[None, :]
    if CAP:
        # Gemma 2's soft-capping, in the scores' log2 units (`softcap` = cap * log2(e)):
        # softcap * tanh(qk / softcap), tanh(y) = 1 - 2 / (e^2y + 1) (saturates, no NaN)
        qk = softcap * (1.0 - 2.0 / (tl.exp2(qk / softcap * 2.8853900817779268) + 1.0))
    # MASK: 0 = every key of the tile is visible, 1 = keys past seq_len hidden, 2 = also causal,
    # 3 = also a sliding window (keys at least `window` positions behind the query hidden)
    if MASK == 1:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    elif MASK == 2:
        qk = tl.where((n[None, :] <= q_pos[:, None]) & nmask[None, :], qk, float("-inf"))
    elif MASK == 3:
        seen = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        qk = tl.where(seen & nmask[None, :], qk, float("-inf"))
    # every row has a visible key in the first tile its caller gives it (key 0 for prefill, the
    # split's first key for decode), so m_new is finite; except with a window, where a row's
    # window may start past the tile: measured from 0 then (no -inf - -inf)
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASK == 3:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALE_AT > 0:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _row_scale(byte_ptr, nmask, SCALE_RCP: tl.constexpr):
    byte = tl.load(byte_ptr.to(tl.pointer_type(tl.uint8)), mask=nmask, other=0).to(tl.int32)
    return tl.where(nmask, bound_of(byte) * SCALE_RCP, 0.0)


@triton.jit
def bound_of(b):
    """The bound scale byte `b` (int32) codes, `reference._bound_bits`: 5 mantissa bits over
    2^1 .. 2^8 (bytes 16-239), 1 bit over the eight octaves either side."""
    low = ((b >> 1) + 120) << 23 | (b & 1) << 22
    band = (((b - 16) >> 5) + 128) << 23 | ((b - 16) & 31) << 18
    high = (((b - 240) >> 1) + 135) << 23 | ((b - 240) & 1) << 22
    bits = tl.where(b < 16, low, tl.where(b < 240, band, high))
    return bits.to(tl.float32, bitcast=True)
