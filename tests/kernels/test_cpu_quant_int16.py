"""`cpu_quant.quant_linear(..., activations="int16")` against a numpy reference: x quantized the
same way (16-bit codes, a float32 scale max|x| / 32767 per 32 elements, rounded to nearest even)
and dequantized, times the weight dequantized by the `gguf` package, in float64: equal up to the
kernel's float32 rounding (the Rust tests check the AVX2 and portable rows bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from quant_paths import (
    assert_only_the_leading_rows_leave_float32,
    assert_prefill_rows_stay_on_float32,
)

from pagedllm.kernels import cpu_quant

# where each type's f16 scales (and mins) sit in its block
_SCALES_AT = {
    cpu_quant.Q8_0: (0,),
    cpu_quant.Q4_0: (0,),
    cpu_quant.Q4_1: (0, 2),
    cpu_quant.Q5_0: (0,),
    cpu_quant.Q5_1: (0, 2),
    cpu_quant.Q4_K: (0, 2),
    cpu_quant.Q5_K: (0, 2),
    cpu_quant.Q6_K: (208,),
}
TYPES = sorted(_SCALES_AT)


def _random_rows(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """`n` rows of random blocks (every code value) with small f16 scales and mins, as uint8
    [n, row_bytes]."""
    rng = np.random.default_rng(seed)
    elems, size = cpu_quant.block_shape(qtype)
    blocks = rng.integers(0, 256, size=(n * k // elems, size), dtype=np.uint8)
    for at in _SCALES_AT[qtype]:
        scale = rng.uniform(-0.03, 0.03, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _int16_x(x: np.ndarray) -> np.ndarray:
    """x [m, k] as its 16-bit codes times their block's scale, float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(32767)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    q = np.rint(blocks * inv[..., None])  # float32 product, rounded to nearest even
    return (q.astype(np.float64) * d[..., None]).reshape(x.shape)


def _weight(qtype: int, rows: np.ndarray, k: int) -> cpu_quant.QuantWeight:
    return cpu_quant.make_weight([(qtype, torch.from_numpy(rows))], k)


# 1-8 rows: the decode products; 9 and 40: the integer panels (rust/src/cpu/quant/gemm16.rs)
@pytest.mark.parametrize("rows_of_x", [1, 5, 8, 9, 40])
@pytest.mark.parametrize("qtype", TYPES, ids=cpu_quant.type_name)
def test_int16_activations_equal_the_dequantized_product_up_to_float32_rounding(qtype, rows_of_x):
    k, n = 512, 7
    rows = _random_rows(qtype, n, k, seed=qtype)
    x = np.random.default_rng(rows_of_x).standard_normal((rows_of_x, k)).astype(np.float32)
    x[0, :32] *= 1e4  # a block far larger than the rest: its own scale
    bias = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    got = cpu_quant.quant_linear(
        torch.from_numpy(x), _weight(qtype, rows, k), torch.from_numpy(bias), activations="int16"
    )
    w = quants.dequantize(rows, GGMLQuantizationType(qtype)).astype(np.float64)
    xq = _int16_x(x)
    want = xq @ w.T + bias
    size = np.abs(xq) @ np.abs(w).T + np.abs(bias)
    assert np.all(np.abs(got.numpy() - want) <= 2e-6 * size)


def test_int16_activations_are_within_x_rounding_of_the_float32_product():
    k, n = 768, 16
    rows = _random_rows(cpu_quant.Q6_K, n, k, seed=5)
    w = _weight(cpu_quant.Q6_K, rows, k)
    x = torch.randn(3, k)
    exact = cpu_quant.quant_linear(x, w, None)
    int16 = cpu_quant.quant_linear(x, w, None, activations="int16")
    # each x within half a code of max|x| / 32767 of its block
    bound = x.reshape(3, -1, 32).abs().amax(-1).repeat_interleave(32, -1) / 65534
    size = bound @ cpu_quant.dequantize(w).abs().T
    assert torch.all((int16 - exact).abs() <= size * 1.01 + 1e-5)
    assert not torch.equal(int16, exact)


def test_int16_activations_leave_prefill_rows_of_a_weight_with_float_rows_on_the_float32_path():
    # the integer panels take a call's rows only where every row of the weight is quantized
    k = 256
    q4_k = torch.from_numpy(_random_rows(cpu_quant.Q4_K, 5, k, seed=2))
    f16 = torch.randn(3, k).to(torch.float16).view(torch.uint8)
    mixed = cpu_quant.make_weight([(cpu_quant.Q4_K, q4_k), (cpu_quant.F16, f16)], k)
    assert_prefill_rows_stay_on_float32(mixed, k, "int16")


def test_int16_activations_leave_float_rows_on_the_float32_path():
    k = 256
    q5_k = torch.from_numpy(_random_rows(cpu_quant.Q5_K, 4, k, seed=3))
    f16 = torch.randn(3, k).to(torch.float16).view(torch.uint8)
    mixed = cpu_quant.make_weight([(cpu_quant.Q5_K, q5_k), (cpu_quant.F16, f16)], k)
    assert_only_the_leading_rows_leave_float32(mixed, k, "int16", leading=4)


def test_engine_layers_default_to_int16_activations(monkeypatch):
    monkeypatch.delenv(cpu_quant.ACTIVATIONS_ENV, raising=False)
    assert cpu_quant.activations_from_env() == "int16"
