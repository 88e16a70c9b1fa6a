"""The paged KV cache on the device, the host swap space, and the block operations the
scheduler asks for each step (swap out, swap in, copy-on-write copies)."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention.kv_groups import KVGroupLayout
from pagedllm.kernels.reference import as_bytes, kv_format, kv_row_size, kv_storage_dtype

if TYPE_CHECKING:
    from pagedllm.worker.kv_calibration import KeyCalibration

logger = logging.getLogger("pagedllm")

# The x86-64 transparent huge page size.
HUGE_PAGE_BYTES = 2 << 20


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype)` on the host, backed by transparent huge pages where the
    kernel grants them (THP `always` or `madvise`; with `never`, or without madvise, ordinary
    pages: the same tensor).

    Why: the CPU attention kernel reads every sequence's keys and values from blocks scattered
    over the cache; with 4 KiB pages each block spans several pages, every one a TLB miss and a
    place where the hardware prefetcher stops. torch has no huge-page allocation, so the memory
    is an anonymous private mapping aligned to 2 MiB, advised before any page is touched.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # private: a shared anonymous mapping is shmem, which follows shmem's THP setting instead
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    with contextlib.suppress(OSError):  # THP not built into the kernel: ordinary pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf` as long as any view lives
    skip = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[skip : skip + nbytes].view(dtype).view(shape)
    # the mapping reads as zeros already; writing them faults every page in now, as
    # torch.zeros does: the memory is committed at start-up, not in the middle of serving
    tensor.zero_()
    return tensor


class CacheEngine:
    """Owns `kv_cache` [2, layers, blocks, block_size, kv_heads, head_dim] and its host twin.
    With hybrid KV groups (`kv_layout`, `attention/kv_groups.py`) `layers` is a block's layer
    slots: a block holds one group's layers.

    One tensor for all layers makes a block copy or swap a single indexed copy. A quantized
    cache (`kv_cache_dtype` int8 / fp8) is of the format's dtype with rows of `head_dim + 1`
    (each row's scale byte after its codes, `kernels.reference`): the scales live in the blocks, so
    every copy, swap and offload of a block carries them.
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
        kv_cache_dtype: str = "auto",
        kv_layout: KVGroupLayout | None = None,
        key_calibration: KeyCalibration | None = None,
    ) -> None:
        self.block_size = block_size
        # a quantized cache's key transform (`worker/kv_calibration.py`): its rows' keys are
        # `(k - c) * s`, so a block means nothing under another calibration
        self.key_calibration = key_calibration
        self.kv_layout = kv_layout
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.kv_cache_dtype = kv_cache_dtype
        dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self._block_shape = (num_layers, block_size, num_kv_heads, kv_row_size(head_dim, dtype))
        # Zeros, not empty: attention kernels mask unused slots, but 0 * NaN garbage is NaN.
        shape = self._shape(num_gpu_blocks)
        if device.type == "cpu":
            self.kv_cache = host_zeros(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._host_cache: torch.Tensor | None = None
        self._dtype = dtype

    @staticmethod
    def bytes_per_block(
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        element = torch.empty((), dtype=dtype).element_size()
        row = kv_row_size(head_dim, dtype)
        return 2 * num_layers * block_size * num_kv_heads * row * element

    @property
    def num_tokens(self) -> int:
        """Tokens the device cache holds (every block full; with hybrid KV groups, tokens of
        every group, as vLLM counts them)."""
        groups = len(self.kv_layout.windows) if self.kv_layout else 1
        return self.num_gpu_blocks // groups * self.block_size

    @property
    def dtype_name(self) -> str:
        """The cache's format: a quantized one's name (int8, fp8_e4m3, fp8_e5m2), else the
        model's dtype (float32, bfloat16, ...)."""
        name = kv_format(self.kv_cache.dtype)
        return str(self.kv_cache.dtype).removeprefix("torch.") if name == "auto" else name

    def stats(self) -> dict:
        """What the cache is: its format, the tokens it holds, its bytes (`get_stats()`)."""
        return {
            "kv_groups": self.kv_layout.describe()
            if self.kv_layout
            else "1 group (full attention)",
            "kv_cache_dtype": self.dtype_name,
            "kv_key_calibration": self.key_calibration.describe()
            if self.key_calibration
            else "off",
            "kv_cache_num_tokens": self.num_tokens,
            "kv_cache_bytes": self.kv_cache.numel() * self.kv_cache.element_size(),
        }

    def log_capacity(self) -> None:
        stats = self.stats()
        logger.info(
            "KV cache: %s (key calibration: %s), %d blocks of %d tokens = %d tokens in %.3f GiB",
            stats["kv_cache_dtype"],
            stats["kv_key_calibration"],
            self.num_gpu_blocks,
            self.block_size,
            stats["kv_cache_num_tokens"],
            stats["kv_cache_bytes"] / (1 << 30),
        )

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
        blocks = self.kv_cache.index_select(2, src).cpu()
        as_bytes(self.host_cache).index_copy_(2, dst, as_bytes(blocks))

    def swap_in(self, pairs: np.ndarray) -> None:
        """(host block, device block) pairs: host -> device."""
        src = torch.from_numpy(np.ascontiguousarray(pairs[:, 0]))
        dst = torch.from_numpy(np.ascontiguousarray(pairs[:, 1])).to(self.device)
        blocks = self.host_cache.index_select(2, src).to(self.device, non_blocking=True)
        as_bytes(self.kv_cache).index_copy_(2, dst, as_bytes(blocks))

    def copy(self, pairs: np.ndarray) -> None:
        """(src, dst) device block pairs for copy-on-write, all layers at once."""
        mapping = torch.from_numpy(np.ascontiguousarray(pairs, dtype=np.int64)).to(self.device)
        if self.device.type == "cuda":
            from pagedllm.kernels import copy_blocks
        else:
            from pagedllm.kernels.reference import copy_blocks
        copy_blocks(self.kv_cache, mapping)
