"""`cpu_quant.quant_linear(..., activations="int8")` against a numpy reference that quantizes
x the same way (8-bit codes, a float32 scale max|x| / 127 per 32 elements, rounded half away
from zero) and takes the same integer dot products: each block's 8 lanes of 4 products scaled
and added in float32 in the kernel's order (even and odd blocks apart), so the results are equal
exactly, not closely."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_paths import (
    assert_only_the_leading_rows_leave_float32,
    assert_prefill_rows_stay_on_float32,
)

from pagedllm.kernels import cpu_quant

# block layout per type: (bytes, offset of the f16 min or None, offset of qh or None, offset
# of the codes, what the codes are minus)
_LAYOUT = {
    cpu_quant.Q8_0: (34, None, None, 2, 0),
    cpu_quant.Q4_0: (18, None, None, 2, 8),
    cpu_quant.Q4_1: (20, 2, None, 4, 0),
    cpu_quant.Q5_0: (22, None, 2, 6, 16),
    cpu_quant.Q5_1: (24, 2, 4, 8, 0),
}
TYPES = sorted(_LAYOUT)


def _random_rows(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """`n` rows of random blocks (every code value, Q8_0's -128 included) with small f16 scales
    and mins, as uint8 [n, row_bytes]."""
    rng = np.random.default_rng(seed)
    size, min_at = _LAYOUT[qtype][:2]
    blocks = rng.integers(0, 256, size=(n * k // 32, size), dtype=np.uint8)
    for at in (0,) if min_at is None else (0, min_at):
        scale = rng.uniform(-0.03, 0.03, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _codes(qtype: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weight as (int32 codes [n, blocks, 32], float32 scales and mins [n, blocks])."""
    size, min_at, qh_at, qs_at, offset = _LAYOUT[qtype]
    b = rows.reshape(rows.shape[0], -1, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = np.zeros_like(d) if min_at is None else b[..., min_at : min_at + 2].copy().view(np.float16)
    m = m.reshape(d.shape).astype(np.float32)
    if qtype == cpu_quant.Q8_0:
        return b[..., 2:34].view(np.int8).astype(np.int32), d, m
    qs = b[..., qs_at : qs_at + 16].astype(np.int32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    if qh_at is not None:
        qh = b[..., qh_at : qh_at + 4].copy().view("<u4").astype(np.int64)
        q = q | (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
    return q - offset, d, m


def _quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [m, k] as (int32 codes [m, blocks, 32], float32 scales d and d·Σcodes [m, blocks])."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    v = blocks * inv[..., None]
    q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int32)
    return q, d, d * q.sum(axis=-1).astype(np.float32)


def _reference(x: np.ndarray, qtype: int, rows: np.ndarray, bias: np.ndarray) -> np.ndarray:
    wq, dw, mw = _codes(qtype, rows)
    xq, dx, sx = _quantize_x(x)
    m, n = x.shape[0], rows.shape[0]
    # even and odd blocks into separate lanes and mins (the kernel's two add chains)
    lanes = np.zeros((2, m, n, 8), dtype=np.float32)
    mins = np.zeros((2, m, n), dtype=np.float32)
    for blk in range(wq.shape[1]):
        ints = np.einsum("nlc,mlc->mnl", wq[:, blk].reshape(n, 8, 4), xq[:, blk].reshape(m, 8, 4))
        d = dw[None, :, blk] * dx[:, None, blk]
        lanes[blk % 2] = lanes[blk % 2] + d[..., None] * ints.astype(np.float32)
        if qtype in (cpu_quant.Q4_1, cpu_quant.Q5_1):
            mins[blk % 2] = mins[blk % 2] + mw[None, :, blk] * sx[:, None, blk]
    a = lanes[0] + lanes[1]
    total = ((a[..., 0] + a[..., 4]) + (a[..., 2] + a[..., 6])) + (
        (a[..., 1] + a[..., 5]) + (a[..., 3] + a[..., 7])
    )
    total = total + (mins[0] + mins[1])
    return total + bias


def _weight(qtype: int, rows: np.ndarray, k: int) -> cpu_quant.QuantWeight:
    return cpu_quant.make_weight([(qtype, torch.from_numpy(rows))], k)


@pytest.mark.parametrize("rows_of_x", [1, 5, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=cpu_quant.type_name)
def test_int8_activations_equal_the_integer_reference_exactly(qtype, rows_of_x):
    k, n = 96, 7  # 3 blocks a row: the last without an odd partner
    rows = _random_rows(qtype, n, k, seed=qtype)
    x = np.random.default_rng(rows_of_x).standard_normal((rows_of_x, k)).astype(np.float32)
    bias = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    got = cpu_quant.quant_linear(
        torch.from_numpy(x), _weight(qtype, rows, k), torch.from_numpy(bias), activations="int8"
    )
    np.testing.assert_array_equal(got.numpy(), _reference(x, qtype, rows, bias))


def test_int8_activations_leave_prefill_rows_on_the_float32_path():
    k = 64
    w = _weight(cpu_quant.Q8_0, _random_rows(cpu_quant.Q8_0, 5, k, seed=2), k)
    assert_prefill_rows_stay_on_float32(w, k, "int8")


def test_int8_activations_leave_k_quant_rows_on_the_float32_path():
    k = 256
    w = cpu_quant.quantize(torch.randn(4, k), cpu_quant.Q8_0)
    q4_k = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (4, 144), dtype=np.uint8))
    q4_k[:, 0:4] = torch.from_numpy(np.full((4, 2), 0.01, np.float16).view(np.uint8))
    mixed = cpu_quant.make_weight([(cpu_quant.Q8_0, w.segments[0].data), (cpu_quant.Q4_K, q4_k)], k)
    assert_only_the_leading_rows_leave_float32(mixed, k, "int8", leading=4)


def test_f32_activations_are_the_dequantized_product():
    k = 64
    w = _weight(cpu_quant.Q4_0, _random_rows(cpu_quant.Q4_0, 6, k, seed=4), k)
    x = torch.randn(2, k)
    default = cpu_quant.quant_linear(x, w, None)
    assert torch.equal(default, cpu_quant.quant_linear(x, w, None, activations="f32"))
    torch.testing.assert_close(default, x @ cpu_quant.dequantize(w).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("value", "activations"),
    [(None, cpu_quant.DEFAULT_ACTIVATIONS), ("f32", "f32"), ("int8", "int8"), ("int16", "int16")],
)
def test_quant_activations_env_selects_the_path(monkeypatch, value, activations):
    if value is None:
        monkeypatch.delenv(cpu_quant.ACTIVATIONS_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_quant.ACTIVATIONS_ENV, value)
    assert cpu_quant.activations_from_env() == activations


def test_quant_activations_env_rejects_other_values(monkeypatch):
    monkeypatch.setenv(cpu_quant.ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ValueError, match="PAGEDLLM_QUANT_ACTIVATIONS='fp8'"):
        cpu_quant.activations_from_env()


def test_quant_linear_rejects_unknown_activations():
    w = cpu_quant.quantize(torch.randn(2, 32), cpu_quant.Q8_0)
    with pytest.raises(ValueError, match="activations 'int4'"):
        cpu_quant.quant_linear(torch.randn(1, 32), w, None, activations="int4")
