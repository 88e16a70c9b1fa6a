"""Which rows the integer-activation paths of `cpu_quant.quant_linear` leave on the float32 path,
shared by the int8 and int16 tests: a prefill batch, and a weight's rows of a type the path does
not take."""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_quant

DECODE_ROWS = 8  # the most rows of x the integer paths take


def assert_prefill_rows_stay_on_float32(weight: cpu_quant.QuantWeight, k: int, activations: str):
    x = torch.randn(DECODE_ROWS + 1, k)
    exact = cpu_quant.quant_linear(x, weight, None)
    assert torch.equal(cpu_quant.quant_linear(x, weight, None, activations=activations), exact)


def assert_only_the_leading_rows_leave_float32(
    mixed: cpu_quant.QuantWeight, k: int, activations: str, leading: int
):
    """One decode row through `mixed`, whose first `leading` output rows are of a type the
    `activations` path takes and the rest not: the rest equal the float32 path exactly, the first
    do not."""
    x = torch.randn(1, k)
    exact = cpu_quant.quant_linear(x, mixed, None)
    got = cpu_quant.quant_linear(x, mixed, None, activations=activations)
    assert torch.equal(got[:, leading:], exact[:, leading:])
    assert not torch.equal(got[:, :leading], exact[:, :leading])
