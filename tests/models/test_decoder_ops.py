"""The decoder's fused small ops give the same numbers as the formulas they replace."""

from __future__ import annotations

import torch

from pagedllm.models.decoder import RMSNorm


def _formula(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def test_float32_rms_norm_is_bit_identical_to_the_formula():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48, generator=g)
    for shape in [(5, 48), (3, 4, 48)]:  # hidden states and per-head q/k norms
        x = torch.randn(shape, generator=g) * 7
        assert torch.equal(norm(x), _formula(x, norm.weight, 1e-6))


def test_half_precision_rms_norm_keeps_the_float32_formula():
    norm = RMSNorm(16, 1e-5).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert torch.equal(norm(x), _formula(x, norm.weight, 1e-5))
