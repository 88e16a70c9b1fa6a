"""Triton kernels: batched LoRA shrink and expand over a step's tokens grouped by adapter slot
(segmented matmuls, punica's SGMV idea). The torch reference and the segment layout are in
`lora_reference.py`.

One program computes a `[BLOCK_M, BLOCK_N]` tile of one segment: its token rows are gathered
through `token_order`, the slot's weight matrix is shared by all of them (so the product is a
`tl.dot`), and the result is scattered back to the same rows. Every (token, column) pair
belongs to exactly one program, so expand adds into `out` without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import dot_precision, interpreting, next_pow2
from .lora_reference import LoRASegments


@triton.jit
def _tile(order_ptr, starts_ptr, slots_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: its segment's token rows (gathered through `token_order`), the
    segment's adapter slot, and its output columns."""
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g)
    end = tl.load(starts_ptr + g + 1)
    idx = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = idx < end
    rows = tl.load(order_ptr + idx, mask=row_mask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, row_mask, slot, n, n < N


@triton.jit
def _load_rows(ptr, rows, row_mask, stride, cols, col_mask):
    """Columns `cols` of the token rows `rows`: [BLOCK_M, len(cols)], 0 where masked."""
    return tl.load(
        ptr + rows[:, None] * stride + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )


@triton.jit
def _load_slot_t(w_ptr, slot, stride_ws, stride_wn, n, n_mask, c, c_mask):
    """The slot's weight rows `n`, columns `c`, read transposed: [len(c), len(n)]."""
    return tl.load(
        w_ptr + slot * stride_ws + n[None, :] * stride_wn + c[:, None],
        mask=c_mask[:, None] & n_mask[None, :],
        other=0.0,
    )


@triton.jit
def _shrink_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    order_ptr,
    starts_ptr,
    slots_ptr,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_yt,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    rows, row_mask, slot, n, n_mask = _tile(order_ptr, starts_ptr, slots_ptr, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xb = _load_rows(x_ptr, rows, row_mask, stride_xt, k, k_mask)
        # the slot's A read transposed: [BLOCK_K, BLOCK_N]
        wb = _load_slot_t(w_ptr, slot, stride_ws, stride_wn, n, n_mask, k, k_mask)
        wb = wb.to(xb.dtype)
        if UPCAST:
            # the interpreter's bf16 dot is wrong: multiply in float32 there
            xb, wb = xb.to(tl.float32), wb.to(tl.float32)
        acc += tl.dot(xb, wb, input_precision=DOT_PREC)
    tl.store(
        y_ptr + rows[:, None] * stride_yt + n[None, :],
        acc,
        mask=row_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    w_ptr,
    out_ptr,
    order_ptr,
    starts_ptr,
    slots_ptr,
    stride_yt,
    stride_ws,
    stride_wn,
    stride_ot,
    N,
    R,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    rows, row_mask, slot, n, n_mask = _tile(order_ptr, starts_ptr, slots_ptr, N, BLOCK_M, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    yb = _load_rows(y_ptr, rows, row_mask, stride_yt, r, r_mask)
    # the slot's B read transposed: [BLOCK_R, BLOCK_N]
    wb = _load_slot_t(w_ptr, slot, stride_ws, stride_wn, n, n_mask, r, r_mask)
    delta = tl.dot(yb, wb.to(tl.float32), input_precision=DOT_PREC)
    mask = row_mask[:, None] & n_mask[None, :]
    dst = out_ptr + rows[:, None] * stride_ot + n[None, :]
    base = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(seg: LoRASegments) -> int:
    # decode segments are short (a few tokens per adapter); tl.dot needs at least 16 rows
    return 16 if seg.max_seg_len <= 16 else 32


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg: LoRASegments) -> torch.Tensor:
    """x `[T, K]`, a `[S, N, K]` -> float32 `[T, N]` (rows of tokens without an adapter are
    unspecified), as `lora_reference.lora_shrink`."""
    num_slots, n, k = a.shape
    assert x.stride(1) == 1 and a.stride(2) == 1, "unit-stride rows expected"
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    block_m = _block_m(seg)
    block_n = max(16, min(next_pow2(n), 64))
    grid = (len(seg.groups), triton.cdiv(seg.max_seg_len, block_m), triton.cdiv(n, block_n))
    _shrink_kernel[grid](
        x,
        a,
        y,
        seg.token_order,
        seg.seg_starts,
        seg.seg_slots,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        y.stride(0),
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=max(16, min(next_pow2(k), 64)),
        UPCAST=interpreting(),
        DOT_PREC=dot_precision(x.dtype),
    )
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    seg: LoRASegments,
    out: torch.Tensor,
    y_offset: int,
    out_offset: int,
) -> None:
    """out[t, out_offset:out_offset+N] += y[t, y_offset:y_offset+R] @ b[slot(t)].T in place, as
    `lora_reference.lora_expand`; b `[S, N, R]`."""
    num_slots, n, r = b.shape
    assert out.stride(1) == 1 and b.stride(2) == 1 and y.stride(1) == 1
    block_m = _block_m(seg)
    block_n = max(16, min(next_pow2(n), 64))
    grid = (len(seg.groups), triton.cdiv(seg.max_seg_len, block_m), triton.cdiv(n, block_n))
    _expand_kernel[grid](
        y[:, y_offset:],
        b,
        out[:, out_offset:],
        seg.token_order,
        seg.seg_starts,
        seg.seg_slots,
        y.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        n,
        r,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, next_pow2(r)),
        DOT_PREC=dot_precision(torch.float32),
    )
