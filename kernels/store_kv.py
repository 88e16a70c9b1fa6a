"""Triton kernel: write this step's K/V into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import next_pow2


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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    dst = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k/v `[T, KVH, D]` -> caches `[num_blocks, block_size, KVH, D]` at `slot_mapping` (-1
    skipped)."""
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
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
