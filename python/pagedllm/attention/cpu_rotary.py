"""Rotary embedding applied in place on the CPU through the Rust kernel
(`pagedllm._core.cpu_rotary_in_place`): the q/k heads are rotated where they sit in the fused
projection's output, no head-sized temporaries (torch's formula makes three per layer)."""

from __future__ import annotations

from torch import Tensor

from pagedllm import _core
from pagedllm.kernels.cpu_arrays import kernel_dtype, numpy_view


class RopeTables:
    """A step's cos/sin `[T, D / 2]`, shared by every layer; on the CPU in a dtype the kernels
    take (`kernels.cpu_arrays.kernel_dtype`) also their numpy views for the kernel, made once
    per step rather than once per layer."""

    __slots__ = ("cos", "sin", "arrays")

    def __init__(self, cos: Tensor, sin: Tensor) -> None:
        self.cos, self.sin = cos, sin
        on_cpu = cos.device.type == "cpu" and kernel_dtype(cos.dtype)
        self.arrays = (
            (numpy_view(cos.contiguous()), numpy_view(sin.contiguous())) if on_cpu else None
        )


def supports(x: Tensor, tables: RopeTables) -> bool:
    """Whether the kernel handles x: on the CPU in the tables' dtype (float32 or bfloat16), each
    head contiguous."""
    return tables.arrays is not None and x.dtype == tables.cos.dtype and x.stride(-1) == 1


def rotary_in_place(x: Tensor, tables: RopeTables) -> None:
    """Rotate x `[T, heads, D]` in place by the step's angles (see `supports`)."""
    cos, sin = tables.arrays
    _core.cpu_rotary_in_place(numpy_view(x), cos, sin)
