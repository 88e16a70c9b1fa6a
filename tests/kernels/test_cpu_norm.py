"""RMS norm through the Rust kernel (`kernels/cpu_norm.py`, `rust/src/cpu/norm.rs`) against the
reference formula (transformers' `LlamaRMSNorm`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import _core
from pagedllm.kernels import cpu_norm


def _formula(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 512), (7, 37), (0, 16)])
def test_float32_rows_equal_the_formula_up_to_the_sums_order(shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen) * 5
    weight = torch.randn(shape[1], generator=gen)
    out = cpu_norm.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, _formula(x, weight, 1e-6), rtol=2e-6, atol=1e-6)


def test_bfloat16_rows_round_as_the_formula_does():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 64, generator=gen) * 3).to(torch.bfloat16)
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    out = cpu_norm.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.bfloat16
    # the scale may move by a float32 ulp with the sum's order: one bfloat16 step at most
    torch.testing.assert_close(out, _formula(x, weight, 1e-5), rtol=2**-7, atol=0)


def test_a_strided_view_of_heads_is_normalized_per_head():
    # the q/k norm's input: q heads viewed out of the fused q/k/v rows (not contiguous)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 4 * 16 + 2 * 16, generator=gen)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    weight = torch.randn(16, generator=gen)
    out = cpu_norm.rms_norm(q, weight, 1e-6)
    assert out.shape == (3, 4, 16)
    torch.testing.assert_close(out, _formula(q, weight, 1e-6), rtol=2e-6, atol=1e-6)


def test_the_kernel_names_a_weight_of_the_wrong_size():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight 7 elements"):
        _core.cpu_rms_norm(x, np.ones(7, np.float32), 1e-6, np.zeros((2, 8), np.float32))


def test_the_kernel_names_a_strided_weight():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="weight must be a contiguous 1-D array"):
        _core.cpu_rms_norm(x, np.ones(16, np.float32)[::2], 1e-6, np.zeros((2, 8), np.float32))


def test_half_precision_is_left_to_torch():
    x = torch.randn(2, 8).to(torch.float16)
    assert not cpu_norm.supports(x, torch.ones(8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_the_kernels_norm_of_the_sum(dtype):
    # the residual step between two blocks: the same numbers as torch's add then the norm
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 48, generator=gen) * 3).to(dtype)
    residual = (torch.randn(5, 48, generator=gen) * 3).to(dtype)
    weight = torch.randn(48, generator=gen).to(dtype)
    total = x + residual
    want = cpu_norm.rms_norm(total, weight, 1e-6)
    normed, summed = cpu_norm.add_rms_norm(x, residual, weight, 1e-6)
    assert normed is x and summed is residual  # in place: no new buffers
    assert torch.equal(summed, total)
    assert torch.equal(normed, want)


def test_add_rms_norm_refuses_one_buffer_as_both_inputs():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="share no memory"):
        _core.cpu_add_rms_norm(x, x, np.ones(8, np.float32), 1e-6)


def test_the_add_kernel_names_a_residual_of_another_shape():
    x, res = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match=r"residual \[3, 8\]"):
        _core.cpu_add_rms_norm(x, res, np.ones(8, np.float32), 1e-6)


def test_strided_rows_are_left_to_torch_by_the_add():
    x = torch.randn(4, 16)[:, :8]
    assert not cpu_norm.supports_add(x, torch.randn(4, 8), torch.ones(8))
    assert cpu_norm.supports_add(x.contiguous(), torch.randn(4, 8), torch.ones(8))
