"""Triton kernel: copy-on-write block copies for every layer of the whole KV cache in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import next_pow2


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, map_ptr, stride_plane, stride_block, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr
):
    # grid (pair, k/v x layer plane): each program copies one whole block of one plane
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    src = tl.load(map_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(map_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + plane * stride_plane
    for off in range(0, BLOCK_NUMEL, CHUNK):
        idx = off + tl.arange(0, CHUNK)
        mask = idx < BLOCK_NUMEL
        x = tl.load(base + src * stride_block + idx, mask=mask)
        tl.store(base + dst * stride_block + idx, x, mask=mask)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """`kv_cache[:, :, dst] = kv_cache[:, :, src]` for each row (src, dst) of `block_mapping`
    [N, 2].

    Sources and destinations must be disjoint (true for copy-on-write pairs).
    """
    n = block_mapping.shape[0]
    if n == 0:
        return
    assert kv_cache.is_contiguous()
    two, layers, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    # 2048 elements per step: 4 warps x 32 lanes x 16 elems, wide vector loads on a pure copy
    chunk = min(2048, next_pow2(block_numel))
    _copy_blocks_kernel[(n, two * layers)](
        kv_cache,
        mapping,
        kv_cache.stride(1),
        kv_cache.stride(2),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4 if chunk >= 512 else 1,
    )
