"""A quantized KV cache (`kv_cache_dtype` int8 / fp8) in the cache engine: blocks sized by their
bytes (codes plus each row's float32 scale), and every path that moves blocks (copy-on-write,
swap out and in, the offload tier's gather / scatter) moving the codes and scales bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels.reference import dequantize_rows, store_kvcache
from pagedllm.kv_transfer.worker import gather_blocks, scatter_blocks
from pagedllm.worker.cache_engine import CacheEngine

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _bytes_per_block(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    return CacheEngine.bytes_per_block(
        num_layers=2,
        num_kv_heads=4,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_a_quantized_block_takes_one_byte_per_value_plus_one_per_row(head_dim):
    float32 = _bytes_per_block(head_dim, torch.float32, "auto")
    bf16 = _bytes_per_block(head_dim, torch.bfloat16, "auto")
    for name in FORMATS:
        quantized = _bytes_per_block(head_dim, torch.float32, name)
        assert quantized == 2 * 2 * 16 * 4 * (head_dim + 1)
        # the same budget holds 4d / (d + 1) times float32's blocks, 2d / (d + 1) bfloat16's
        assert float32 / quantized == pytest.approx(4 * head_dim / (head_dim + 1))
        assert bf16 / quantized == pytest.approx(2 * head_dim / (head_dim + 1))
    # from head size 64 (SmolLM2, Llama-3.2-1B): >= 3.9x float32's tokens, >= 1.95x bfloat16's
    if head_dim >= 64:
        assert float32 / _bytes_per_block(head_dim, torch.float32, "int8") >= 3.9
        assert bf16 / _bytes_per_block(head_dim, torch.bfloat16, "fp8") >= 1.95


def _engine(kv_cache_dtype: str) -> CacheEngine:
    return CacheEngine(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        num_gpu_blocks=6,
        num_cpu_blocks=3,
        dtype=torch.float32,
        device=torch.device("cpu"),
        kv_cache_dtype=kv_cache_dtype,
    )


def _fill(engine: CacheEngine) -> None:
    """Random keys and values stored (quantized) into every slot of every layer."""
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(engine.num_gpu_blocks * engine.block_size)
    for layer in range(engine.kv_cache.shape[1]):
        k, v = (torch.randn(len(slots), 2, 8, generator=g) * 3 for _ in range(2))
        store_kvcache(k, v, engine.kv_cache[0, layer], engine.kv_cache[1, layer], slots)


def _block_bytes(engine: CacheEngine, block: int) -> torch.Tensor:
    return engine.kv_cache[:, :, block].view(torch.uint8).clone()


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_the_cache_is_of_the_formats_dtype_with_room_for_each_rows_scale(kv_cache_dtype):
    engine = _engine(kv_cache_dtype)
    assert engine.kv_cache.dtype == FORMATS[kv_cache_dtype]
    assert engine.kv_cache.shape == (2, 2, 6, 4, 2, 8 + 1)
    assert engine.num_tokens == 24


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_copy_on_write_copies_codes_and_scales(kv_cache_dtype):
    engine = _engine(kv_cache_dtype)
    _fill(engine)
    want = [_block_bytes(engine, 1), _block_bytes(engine, 4)]
    empty = np.empty((0, 2), np.int64)
    engine.execute(empty, empty, np.array([[1, 2], [4, 5]]))
    assert torch.equal(_block_bytes(engine, 2), want[0])
    assert torch.equal(_block_bytes(engine, 5), want[1])
    # the copied scales still dequantize to the source's values
    values = dequantize_rows(engine.kv_cache[:, :, 2])
    assert torch.equal(values, dequantize_rows(engine.kv_cache[:, :, 1]))
    assert bool(values.abs().sum() > 0)


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_swap_out_and_in_moves_codes_and_scales(kv_cache_dtype):
    engine = _engine(kv_cache_dtype)
    _fill(engine)
    want = [_block_bytes(engine, 0), _block_bytes(engine, 3)]
    empty = np.empty((0, 2), np.int64)
    engine.execute(np.array([[0, 2], [3, 0]]), empty, empty)
    engine.kv_cache.view(torch.uint8).zero_()
    engine.execute(empty, np.array([[2, 5], [0, 1]]), empty)
    assert torch.equal(_block_bytes(engine, 5), want[0])
    assert torch.equal(_block_bytes(engine, 1), want[1])


@pytest.mark.parametrize("kv_cache_dtype", list(FORMATS))
def test_the_offload_tiers_gather_and_scatter_move_codes_and_scales(kv_cache_dtype):
    engine = _engine(kv_cache_dtype)
    _fill(engine)
    want = _block_bytes(engine, 2)
    data = gather_blocks(engine.kv_cache, torch.tensor([2])).contiguous()
    scatter_blocks(engine.kv_cache, torch.tensor([4]), data)
    assert torch.equal(_block_bytes(engine, 4), want)
