"""SwiGLU's activation through the Rust kernel (`kernels/cpu_activation.py`,
`rust/src/cpu/activation.rs`) against torch's `silu(gate) * up`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import _core
from pagedllm.kernels.cpu_activation import silu_and_mul


def _torch(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gate_up(shape, dtype, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 6).to(dtype)


@pytest.mark.parametrize("shape", [(1, 2 * 1376), (7, 2 * 37), (0, 16), (2, 3, 2 * 24)])
def test_float32_equals_torch_within_a_few_ulp(shape):
    gate_up = _gate_up(shape, torch.float32)
    out = silu_and_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    # torch's exp and the kernel's may differ in the last bit
    torch.testing.assert_close(out, _torch(gate_up), rtol=5e-7, atol=1e-30)


def test_bfloat16_rounds_silu_then_the_product_as_torch_does():
    gate_up = _gate_up((6, 2 * 64), torch.bfloat16, seed=1)
    out = silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16
    # a last-bit difference in silu's float32 value may move its bfloat16 rounding one step
    torch.testing.assert_close(out, _torch(gate_up), rtol=2**-7, atol=0)
    assert (out != _torch(gate_up)).float().mean() < 0.01


def test_a_prefill_sized_call_on_threads_equals_one_thread():
    gate_up = _gate_up((300, 2 * 1000), torch.float32, seed=2)
    out = np.empty((300, 1000), np.float32)
    one = np.empty_like(out)
    _core.cpu_silu_and_mul(gate_up.numpy(), out, 4)
    _core.cpu_silu_and_mul(gate_up.numpy(), one, 1)
    assert np.array_equal(out, one)


def test_the_kernel_names_an_out_of_the_wrong_width():
    with pytest.raises(ValueError, match=r"want \[T, 2I\], \[T, I\]"):
        _core.cpu_silu_and_mul(np.zeros((2, 10), np.float32), np.zeros((2, 4), np.float32), 1)


def test_half_precision_uses_torchs_formula():
    gate_up = _gate_up((3, 32), torch.float16)
    assert torch.equal(silu_and_mul(gate_up), _torch(gate_up))
