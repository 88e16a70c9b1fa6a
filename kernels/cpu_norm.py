"""RMS norm on the CPU through the Rust kernel (`pagedllm._core.cpu_rms_norm`,
`rust/src/cpu/norm.rs`): one call per norm instead of torch's five or six operators (~35 us a
call at decode sizes, 17 norms a step of an 8-layer model; benches/RESULTS.md, "Serving speed
on CPU"). Sums in float32 in the kernel's order; bfloat16 is rounded as the reference formula
rounds it."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedllm import _core
from pagedllm.kernels.cpu_arrays import KERNEL_DTYPES, numpy_view


def supports(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in KERNEL_DTYPES
        and weight.dtype == x.dtype
        and weight.device.type == "cpu"
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x * rsqrt(mean(x^2, -1) + eps))` over the last axis of `x` (a new tensor)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _core.cpu_rms_norm(numpy_view(rows), numpy_view(weight.detach()), eps, numpy_view(out))
    return out.view(x.shape)
