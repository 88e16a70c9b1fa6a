"""The paged KV cache on the device, the host swap space, and the block operations the
scheduler asks for each step (swap out, swap in, copy-on-write copies)."""

from __future__ import annotations

import numpy as np
import torch


class CacheEngine:
    """Owns `kv_cache` [2, layers, blocks, block_size, kv_heads, head_dim] and its host twin.

    One tensor for all layers makes a block copy or swap a single indexed copy.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self._block_shape = (num_layers, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: attention kernels mask unused slots, but 0 * NaN garbage is NaN.
        self.kv_cache = torch.zeros(self._shape(num_gpu_blocks), dtype=dtype, device=device)
        self._host_cache: torch.Tensor | None = None
        self._dtype = dtype

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        layers, block_size, kv_heads, head_dim = self._block_shape
        return (2, layers, num_blocks, block_size, kv_heads, head_dim)

    @property
    def host_cache(self) -> torch.Tensor:
        # Allocated on first swap: most runs never swap, and swap_space is GiBs.
        # torch.empty: a host block is only ever read after it was written by a swap-out.
        if self._host_cache is None:
            pin = self.device.type == "cuda"
            self._host_cache = torch.empty(
                self._shape(self.num_cpu_blocks), dtype=self._dtype, device="cpu", pin_memory=pin
            )
        return self._host_cache

    def execute(
        self,
        blocks_to_swap_out: np.ndarray,
        blocks_to_swap_in: np.ndarray,
        blocks_to_copy: np.ndarray,
    ) -> None:
        """Run a step's block operations before its forward pass.

        Swap-out goes first: the device blocks it frees may be the targets of this step's
        swap-ins or copies.
        """
        if len(blocks_to_swap_out):
            self.swap_out(blocks_to_swap_out)
        if len(blocks_to_swap_in):
            self.swap_in(blocks_to_swap_in)
        if len(blocks_to_copy):
            self.copy(blocks_to_copy)

    def swap_out(self, pairs: np.ndarray) -> None:
        """(device block, host block) pairs: device -> host."""
        src = torch.from_numpy(np.ascontiguousarray(pairs[:, 0])).to(self.device)
        dst = torch.from_numpy(np.ascontiguousarray(pairs[:, 1]))
        self.host_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src).cpu())

    def swap_in(self, pairs: np.ndarray) -> None:
        """(host block, device block) pairs: host -> device."""
        src = torch.from_numpy(np.ascontiguousarray(pairs[:, 0]))
        dst = torch.from_numpy(np.ascontiguousarray(pairs[:, 1])).to(self.device)
        blocks = self.host_cache.index_select(2, src).to(self.device, non_blocking=True)
        self.kv_cache.index_copy_(2, dst, blocks)

    def copy(self, pairs: np.ndarray) -> None:
        """(src, dst) device block pairs for copy-on-write, all layers at once."""
        mapping = torch.from_numpy(np.ascontiguousarray(pairs, dtype=np.int64)).to(self.device)
        if self.device.type == "cuda":
            from pagedllm.kernels import copy_blocks
        else:
            from pagedllm.kernels.reference import copy_blocks
        copy_blocks(self.kv_cache, mapping)
