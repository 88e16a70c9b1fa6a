"""The decoder's fused small ops give the same numbers as the formulas they replace."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.cpu_rotary import RopeTables
from pagedllm.models.config import RopeConfig
from pagedllm.models.decoder import RMSNorm, RotaryEmbedding, apply_rope_


def _formula(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def test_float32_rms_norm_equals_the_formula_up_to_the_sums_order():
    # on the CPU the Rust kernel (kernels/cpu_norm.py) sums x^2 in its own order
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48, generator=g)
    for shape in [(5, 48), (3, 4, 48)]:  # hidden states and per-head q/k norms
        x = torch.randn(shape, generator=g) * 7
        torch.testing.assert_close(norm(x), _formula(x, norm.weight, 1e-6), rtol=2e-6, atol=1e-6)


def test_half_precision_rms_norm_keeps_the_float32_formula():
    norm = RMSNorm(16, 1e-5).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert torch.equal(norm(x), _formula(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_and_norm_normalizes_the_sum_and_returns_it_as_the_residual(dtype):
    # float32/bfloat16: the in-place Rust kernel; float16: torch's add, then the norm
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(32, 1e-6).to(dtype)
    norm.weight.data = torch.randn(32, generator=g).to(dtype)
    x = (torch.randn(6, 32, generator=g) * 3).to(dtype)
    residual = (torch.randn(6, 32, generator=g) * 3).to(dtype)
    total = x + residual
    want = norm(total)
    normed, summed = norm.add_and_norm(x.clone(), residual.clone())
    assert torch.equal(summed, total)
    assert torch.equal(normed, want)


def _rotate_half_formula(x, cos, sin):
    """transformers' rope: x * cos + rotate_half(x) * sin over duplicated [T, D] tables."""
    cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _tables(dtype):
    rope = RotaryEmbedding(16, RopeConfig(theta=10000.0))
    return RopeTables(*rope(torch.tensor([0, 5, 17, 300, 4095]), dtype))


def test_in_place_rope_is_bit_identical_to_rotate_half_on_the_fused_qkv_columns():
    tables = _tables(torch.float32)  # float32 on the CPU: the Rust kernel
    assert tables.arrays is not None
    qkv = torch.randn(5, (6 + 2 + 2) * 16, generator=torch.Generator().manual_seed(1)) * 3
    qk = qkv[:, : 8 * 16].view(5, 8, 16)  # strided: each row skips the v columns
    want = _rotate_half_formula(qk.clone(), tables.cos, tables.sin)
    v_before = qkv[:, 8 * 16 :].clone()
    assert apply_rope_(qk, tables) is qk
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, 8 * 16 :], v_before)


def test_in_place_rope_in_float16_matches_rotate_half():
    tables = _tables(torch.float16)  # the torch path (what CUDA runs)
    assert tables.arrays is None
    x = (torch.randn(5, 3, 16) * 3).to(torch.float16)
    want = _rotate_half_formula(x.clone(), tables.cos, tables.sin)
    assert torch.equal(apply_rope_(x, tables), want)


def test_in_place_rope_in_bfloat16_is_bit_identical_to_rotate_half_on_fused_columns():
    tables = _tables(torch.bfloat16)  # bfloat16 on the CPU: the Rust kernel
    assert tables.arrays is not None
    qkv = (torch.randn(5, 10 * 16, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    qk = qkv[:, : 8 * 16].view(5, 8, 16)
    want = _rotate_half_formula(qk.clone(), tables.cos, tables.sin)
    v_before = qkv[:, 8 * 16 :].clone()
    assert apply_rope_(qk, tables) is qk
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, 8 * 16 :], v_before)
