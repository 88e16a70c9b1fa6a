"""The native offload tier's memory: `num_slots` blocks in host memory, one slot holding a
block of every layer contiguously ([slots, 2, layers, block_size, kv_heads, head_dim]), so
a block moves as one large copy rather than one per layer. Pinned on CUDA (async copies).

Sized exactly: as many whole blocks as `size_bytes` holds, never rounded up.
"""

from __future__ import annotations

import torch


class HostKVPool:
    def __init__(
        self,
        size_bytes: int,
        *,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        """`block_shape`: one block of every layer, (2, layers, block_size, kv_heads, head_dim)."""
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = element * int(torch.Size(block_shape).numel())
        self.num_slots = size_bytes // self.bytes_per_block
        if self.num_slots < 1:
            raise ValueError(
                f"kv_offloading_size ({size_bytes} bytes) holds no KV block "
                f"({self.bytes_per_block} bytes each)"
            )
        self.blocks = torch.empty(
            (self.num_slots, *block_shape), dtype=dtype, device="cpu", pin_memory=pin_memory
        )
        # the block hash each slot holds (checked by every load: a slot overwritten or
        # corrupted since is never loaded into the wrong prefix); -1: nothing
        self.hashes = torch.full((self.num_slots,), -1, dtype=torch.int64)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()
