"""Triton kernel: write this step's K/V into their paged-cache slots; a quantized cache
(`kv_cache_dtype` int8 / fp8) gets each (token, kv head) row rotated (by torch, before the
kernel) and coded with its scale byte, as `reference.quantize_rows` defines (the byte after the
row's HEAD_DIM codes), the keys by error feedback when the key calibration gives it (the same
float32 operations, unfused); a float32 model's rows into a bfloat16 cache rounded as torch
rounds."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tile import bound_of
from ._util import next_pow2
from .reference import KEY_BYTES, hadamard, kv_code_max, kv_format, kv_row_size


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_ch,
    fb_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr = 0.0,
    INT8: tl.constexpr = False,
    FP8_M: tl.constexpr = 0,
    FP8_BIAS: tl.constexpr = 0,
    FEEDBACK: tl.constexpr = 0,
    BF16: tl.constexpr = False,
):
    # one program per token; it moves all kv heads of the token (one contiguous-ish 2-D tile)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: slot * stride can pass 2**31 on big caches
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot -1 (padding) is folded into the mask instead of an early return; the slot is broadcast
    # to the tile first (the interpreter rejects a scalar-bool & block mask)
    slot_tile = slot + tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot_tile >= 0)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    row = slot * stride_cslot + h * stride_ch
    dst = row[:, None] + d[None, :]
    if QMAX > 0:
        row_mask = (h < NUM_KV_HEADS) & (slot + tl.zeros([BLOCK_H], dtype=tl.int64) >= 0)
        fmt = (HEAD_DIM, QMAX, INT8, FP8_M, FP8_BIAS)
        tile = (mask, row_mask, fb_ptr, h, d)
        _store_quantized(kc_ptr, row, dst, k.to(tl.float32), *tile, *fmt, FEEDBACK)
        _store_quantized(vc_ptr, row, dst, v.to(tl.float32), *tile, *fmt, 0)
    elif BF16:
        _store_bf16(kc_ptr, dst, k, mask)
        _store_bf16(vc_ptr, dst, v, mask)
    else:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_bf16(c_ptr, dst, x, mask):
    """float32 `x` into a bfloat16 cache (`kv_cache_dtype="bfloat16"`), rounded to nearest even
    in integer arithmetic as torch rounds: the same bits on the GPU and under the interpreter
    (whose conversion truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    tl.store((c_ptr + dst).to(tl.pointer_type(tl.uint16)), rounded.to(tl.uint16), mask=mask)


@triton.jit
def _store_quantized(
    c_ptr,
    row,
    dst,
    x,
    mask,
    row_mask,
    fb_ptr,
    h,
    d,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr,
    INT8: tl.constexpr,
    FP8_M: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FEEDBACK: tl.constexpr,
):
    # masked lanes loaded 0: they never raise a row's amax. The scale byte (`_bound_byte`): the
    # smallest whose bound is at least amax; the scale its bound times 1 / QMAX (as float32)
    byte = _bound_byte(tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True))
    rcp: tl.constexpr = 1.0 / QMAX
    if FEEDBACK > 0:
        fmt = (HEAD_DIM, QMAX, INT8, FP8_M, FP8_BIAS)
        y, byte = _searched(x, byte, mask, fb_ptr, h, d, *fmt, FEEDBACK)
    else:
        y = x / (bound_of(byte) * rcp)[:, None]
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT8:
        # round half to even: adding 1.5 * 2^23 leaves no fraction bits (|y| <= 127)
        y = (y + 12582912.0) - 12582912.0
        tl.store(c_ptr + dst, y.to(tl.int8), mask=mask)
    else:
        code = _fp8_code(y, FP8_M, FP8_BIAS)
        tl.store((c_ptr + dst).to(tl.pointer_type(tl.uint8)), code, mask=mask)
    byte_ptr = (c_ptr + row + HEAD_DIM).to(tl.pointer_type(tl.uint8))
    tl.store(byte_ptr, byte.to(tl.uint8), mask=row_mask)


@triton.jit
def _searched(
    x,
    byte0,
    mask,
    fb_ptr,
    h,
    d,
    HEAD_DIM: tl.constexpr,
    QMAX,
    INT8,
    FP8_M,
    FP8_BIAS,
    BYTES: tl.constexpr,
):
    """The coded values and scale bytes of rows `x` by error feedback with the byte searched
    (`reference.quantize_rows`): each of `BYTES` bytes from `byte0` up (at most 255) coded
    by `_feedback`, the one of least `acc * scale^2` kept (the first of equals)."""
    rcp: tl.constexpr = 1.0 / QMAX
    best_y, best_err, best_byte = tl.zeros_like(x), tl.zeros_like(byte0.to(tl.float32)), byte0
    for c in range(BYTES):
        byte = tl.minimum(byte0 + c, 255)
        scale = bound_of(byte) * rcp
        y, acc = _feedback(
            x / scale[:, None], mask, fb_ptr, h, d, HEAD_DIM, QMAX, INT8, FP8_M, FP8_BIAS
        )
        err = acc * (scale * scale)
        take = (err < best_err) | (tl.zeros_like(byte0) + c == 0)
        best_y = tl.where(take[:, None], y, best_y)
        best_err = tl.where(take, err, best_err)
        best_byte = tl.where(take, byte, best_byte)
    return best_y, best_byte


@triton.jit
def _feedback(y, mask, fb_ptr, h, d, HEAD_DIM: tl.constexpr, QMAX, INT8, FP8_M, FP8_BIAS):
    """The coded values of rows `y` (already divided by their scale) chosen by error feedback
    (`reference.quantize_rows`): column by column the value so far coded, its error pushed onto
    the later columns through the head's feedback matrix (`[KVH, D, D]`, used above the
    diagonal), and the errors' squares summed weighted by its diagonal. A column is taken out
    by its bits (an integer sum: exact, signed zeros kept)."""
    w = y
    coded = tl.zeros_like(y)
    acc = tl.zeros_like(tl.sum(y, axis=1))
    for j in tl.static_range(HEAD_DIM):
        column = d[None, :] == j
        bits = tl.sum(tl.where(column, w.to(tl.int32, bitcast=True), 0), axis=1)
        wj = bits.to(tl.float32, bitcast=True)
        cj = tl.minimum(tl.maximum(wj, -QMAX), QMAX)
        vj = (cj + 12582912.0) - 12582912.0 if INT8 else _fp8_value(cj, FP8_M, FP8_BIAS)
        coded = tl.where(column, vj[:, None], coded)
        u = tl.load(
            fb_ptr + h[:, None] * HEAD_DIM * HEAD_DIM + j * HEAD_DIM + d[None, :],
            mask=mask,
            other=0.0,
        )
        g = tl.sum(tl.where(column, u.to(tl.int32, bitcast=True), 0), axis=1)
        e = wj - vj
        acc = acc + e * e * g.to(tl.float32, bitcast=True)
        w = w - e[:, None] * tl.where(d[None, :] > j, u, 0.0)
    return coded, acc


@triton.jit
def _fp8_value(y, M: tl.constexpr, BIAS: tl.constexpr):
    """The value of `_fp8_code(y)` as float32 (|y| <= the format's max): the same rounding."""
    a = tl.abs(y)
    step: tl.constexpr = 2.0 ** (BIAS - 1 + M)
    steps = (a * step + 12582912.0) - 12582912.0
    abits = a.to(tl.uint32, bitcast=True)
    SHIFT: tl.constexpr = 23 - M
    rounded = abits + ((1 << (SHIFT - 1)) - 1) + ((abits >> SHIFT) & 1)
    normal = ((rounded >> SHIFT) << SHIFT).to(tl.float32, bitcast=True)
    min_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    value = tl.where(a < min_normal, steps * (1.0 / step), normal)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -value, value)


@triton.jit
def _bound_byte(bits):
    """`reference._bound_byte` on amax's bits: rounded up to 5 mantissa bits in the band (2 to
    256, bytes 16-239), to 1 outside (2^-7 to 2: 0-15, 256 to 49152: 240-255), clamped to a
    byte."""
    up5 = (bits + 262143) >> 18
    up1 = (bits + 4194303) >> 22
    e5 = (up5 >> 5) - 127
    e1 = (up1 >> 1) - 127
    low = ((e1 + 7) << 1) + (up1 & 1)
    band = 16 + ((e5 - 1) << 5) + (up5 & 31)
    high = 240 + ((e1 - 8) << 1) + (up1 & 1)
    byte = tl.where(e5 < 1, low, tl.where(e5 < 8, band, high))
    return tl.minimum(tl.maximum(byte, 0), 255)


@triton.jit
def _fp8_code(y, M: tl.constexpr, BIAS: tl.constexpr):
    """The fp8 code (M mantissa bits, exponent bias BIAS) of y (|y| <= the format's max), rounded
    to nearest even, in integer arithmetic: the same bits on the GPU and under the interpreter
    (whose float-to-fp8 conversion does not round as torch does)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = tl.abs(y)
    # below the smallest normal 2^(1 - BIAS): multiples of the subnormal step (exact scaling),
    # rounded half to even (1.5 * 2^23 trick; at most 2^M steps)
    step: tl.constexpr = 2.0 ** (BIAS - 1 + M)
    steps = ((a * step + 12582912.0) - 12582912.0).to(tl.uint32)
    abits = a.to(tl.uint32, bitcast=True)
    SHIFT: tl.constexpr = 23 - M
    rounded = abits + ((1 << (SHIFT - 1)) - 1) + ((abits >> SHIFT) & 1)
    exponent = (rounded >> 23) - 127 + BIAS
    normal = (exponent << M) | ((rounded >> SHIFT) & ((1 << M) - 1))
    min_normal: tl.constexpr = 2.0 ** (1 - BIAS)
    code = tl.where(a < min_normal, steps, normal)
    return (code | sign).to(tl.uint8)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_feedback: torch.Tensor | None = None,
) -> None:
    """k/v `[T, KVH, D]` -> caches `[num_blocks, block_size, KVH, D]` at `slot_mapping` (-1
    skipped); `key_feedback` float32 `[KVH, D, D]`: a quantized cache's keys coded by error
    feedback."""
    T, kvh, d = k.shape
    if T == 0:
        return
    # the head-dim must be unit-stride (k/v may be strided views of a fused qkv output)
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    for c in (k_cache, v_cache):
        assert c.stride(3) == 1 and c.stride(0) == c.shape[1] * c.stride(1), (
            "cache slots must be flat"
        )
    assert k_cache.stride() == v_cache.stride()
    qmax = 0.0
    if kv_format(k_cache.dtype) == "auto":
        key_feedback = None
    if key_feedback is not None:
        key_feedback = key_feedback.to(device=k.device, dtype=torch.float32).contiguous()
    if kv_format(k_cache.dtype) != "auto":
        assert k_cache.shape[3] == kv_row_size(d, k_cache.dtype), "rows do not match k's heads"
        qmax = kv_code_max(k_cache.dtype)
        # the rows are coded rotated (`reference.hadamard`, the same float32 operations)
        k, v = hadamard(k.float()), hadamard(v.float())
    block_h, block_d = next_pow2(kvh), next_pow2(d)
    # the kernel is pure data movement; 4 warps cover up to 8 heads x 128 dims at 8 elems/thread
    _store_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        k if key_feedback is None else key_feedback,  # (unread without feedback)
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QMAX=qmax,
        INT8=k_cache.dtype == torch.int8,
        FP8_M={torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}.get(k_cache.dtype, 0),
        FP8_BIAS={torch.float8_e4m3fn: 7, torch.float8_e5m2: 15}.get(k_cache.dtype, 0),
        # the feedback's candidate scale bytes (0: none; int8 keeps the first)
        FEEDBACK=0 if key_feedback is None else 1 if k_cache.dtype == torch.int8 else KEY_BYTES,
        BF16=k.dtype == torch.float32 and k_cache.dtype == torch.bfloat16,
        num_warps=4 if block_h * block_d >= 1024 else 1,
        # the feedback's multiply and subtract each rounded, as the reference's
        enable_fp_fusion=key_feedback is None,
    )
