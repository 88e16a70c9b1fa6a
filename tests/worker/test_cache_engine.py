"""The host KV cache's allocation (`host_zeros`): torch.zeros' tensor, on transparent huge pages
where the kernel grants them, and ordinary pages where it cannot."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.worker import cache_engine
from pagedllm.worker.cache_engine import HUGE_PAGE_BYTES, CacheEngine, host_zeros

# 2 x 2 layers x 64 blocks x 16 slots x 4 heads x 64 floats: 8 MiB, several huge pages
SHAPE = (2, 2, 64, 16, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_zeros_is_a_contiguous_zero_tensor_of_the_shape_and_dtype(dtype):
    t = host_zeros(SHAPE, dtype)
    assert t.shape == SHAPE and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous()
    assert torch.equal(t, torch.zeros(SHAPE, dtype=dtype))


def test_host_zeros_starts_on_a_huge_page_boundary():
    assert host_zeros(SHAPE, torch.float32).data_ptr() % HUGE_PAGE_BYTES == 0


def test_host_zeros_memory_outlives_every_name_but_the_tensor():
    t = host_zeros(SHAPE, torch.float32)
    t.view(-1)[-1] = 7.0
    view = t[1, 1]
    del t
    gc.collect()
    view.view(-1)[0] = 3.0  # still writable memory: the mapping lives as long as a view
    assert view.view(-1)[-1].item() == 7.0 and view.view(-1)[0].item() == 3.0


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return "never"
    return path.read_text().split("[", 1)[1].split("]", 1)[0]


def _smaps_field(address: int, field: str) -> int | None:
    """`field` of this process's mapping holding `address` (None without /proc or the field)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    inside = False
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == field + ":":
            return int(line.split()[1])
    return None


def test_host_zeros_is_eligible_for_huge_pages_when_the_kernel_allows_them():
    # eligibility, not AnonHugePages: whether a huge page was free to hand out at fault time
    # depends on the machine's fragmentation, the advice does not
    t = host_zeros(SHAPE, torch.float32)
    eligible = _smaps_field(t.data_ptr(), "THPeligible")
    assert eligible is not None, "no THPeligible in /proc/self/smaps"
    assert eligible == (1 if _thp_mode() in ("always", "madvise") else 0)
    assert torch.equal(t, torch.zeros(SHAPE))


def test_host_zeros_works_when_madvise_is_refused(monkeypatch):
    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    t = host_zeros(SHAPE, torch.bfloat16)
    assert t.shape == SHAPE and t.dtype == torch.bfloat16
    assert torch.equal(t, torch.zeros(SHAPE, dtype=torch.bfloat16))


def test_host_zeros_is_torch_zeros_where_madvise_does_not_exist(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    monkeypatch.setattr(mmap, "mmap", None)  # never reached
    t = host_zeros(SHAPE, torch.float32)
    assert t.shape == SHAPE and torch.equal(t, torch.zeros(SHAPE))


def test_host_zeros_below_one_huge_page_is_torch_zeros(monkeypatch):
    monkeypatch.setattr(mmap, "mmap", None)  # a small tensor never maps memory of its own
    t = host_zeros((3, 5), torch.float32)
    assert torch.equal(t, torch.zeros(3, 5))


def _engine() -> CacheEngine:
    return CacheEngine(
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        block_size=16,
        num_gpu_blocks=64,
        num_cpu_blocks=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_cpu_cache_engine_allocates_its_cache_with_host_zeros(monkeypatch):
    calls = []

    def spy(shape, dtype):
        calls.append((shape, dtype))
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(cache_engine, "host_zeros", spy)
    engine = _engine()
    assert calls == [(SHAPE, torch.float32)]
    assert engine.kv_cache.shape == SHAPE


def test_cpu_cache_on_huge_pages_swaps_and_copies_blocks():
    engine = _engine()
    assert engine.kv_cache.data_ptr() % HUGE_PAGE_BYTES == 0
    engine.kv_cache[:, :, 5] = 1.5
    engine.copy(np.array([[5, 9]]))
    assert torch.equal(engine.kv_cache[:, :, 9], engine.kv_cache[:, :, 5])
    engine.swap_out(np.array([[9, 2]]))
    engine.kv_cache[:, :, 9] = 0.0
    engine.swap_in(np.array([[2, 9]]))
    assert bool((engine.kv_cache[:, :, 9] == 1.5).all())
