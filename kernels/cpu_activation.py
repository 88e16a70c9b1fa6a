"""SwiGLU's activation on the CPU through the Rust kernel (`pagedllm._core.cpu_silu_and_mul`,
`rust/src/cpu/activation.rs`): `silu(gate) * up` read straight from the fused gate/up
projection's output into one new buffer, one call instead of torch's silu (a temporary) and
product."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedllm import _core
from pagedllm.kernels.cpu_arrays import KERNEL_DTYPES, numpy_view


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """`silu(gate) * up` of `gate_up` `[..., 2I]` (gate columns, then up columns) -> `[..., I]`.
    On the CPU in float32 or bfloat16 the Rust kernel; elsewhere torch's formula."""
    width = gate_up.shape[-1] // 2
    if gate_up.device.type != "cpu" or gate_up.dtype not in KERNEL_DTYPES:
        gate, up = gate_up.split(width, dim=-1)
        # silu's fresh output takes the product in place: one activation-sized buffer less
        return F.silu(gate).mul_(up)
    rows = gate_up.reshape(-1, 2 * width).contiguous()
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype)
    _core.cpu_silu_and_mul(numpy_view(rows), numpy_view(out), torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], width)
