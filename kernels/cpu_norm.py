"""RMS norm on the CPU through the Rust kernel (`pagedllm._core.cpu_rms_norm`,
`rust/src/cpu/norm.rs`): one call per norm instead of torch's five or six operators (~35 us a
call at decode sizes, 17 norms a step of an 8-layer model; benches/RESULTS.md, "Serving speed
on CPU"). Sums in float32 in the kernel's order; bfloat16 is rounded as the reference formula
rounds it.

`add_rms_norm` is the residual step between two blocks (vLLM's `fused_add_rms_norm`): the
block's output added into the residual and the sum normalized, in place, in one call."""

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


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`residual + x` and its RMS norm, as `(normalized, sum)`, written in place: the sum into
    `residual`, the normalized rows into `x` (both `[T, E]`, contiguous, distinct; see
    `supports_add`). Equal to `rms_norm(x + residual)` with the sum rounded to the dtype."""
    _core.cpu_add_rms_norm(numpy_view(x), numpy_view(residual), numpy_view(weight), eps)
    return x, residual


def supports_add(x: Tensor, residual: Tensor, weight: Tensor) -> bool:
    """Whether `add_rms_norm` takes these: `supports`, and x and residual contiguous rows of one
    shape and dtype."""
    return (
        supports(x, weight)
        and residual.dtype == x.dtype
        and residual.shape == x.shape
        and x.dim() == 2
        and x.is_contiguous()
        and residual.is_contiguous()
    )
