"""`argmax_rows` (the Rust kernel on CPU float32) picks what `torch.argmax` picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import _core
from pagedllm.sampling.ops import argmax_rows


@pytest.mark.parametrize("shape", [(1, 32000), (64, 1001), (3, 5), (0, 16)])
def test_float32_rows_pick_torchs_argmax(shape):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    got = argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))


def test_ties_and_nans_follow_torch():
    logits = torch.zeros(4, 50)
    logits[0, [9, 40]] = 3.0  # a tie: the first
    logits[1, [17, 30]] = float("nan")  # NaN counts as the largest: the first NaN
    logits[2, 49] = 1.0  # in the tail after the 8-wide chunks
    logits[3] = float("-inf")  # every token masked
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == [9, 17, 49, 0]


def test_a_non_contiguous_view_is_read_correctly():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    view = logits[::2, 7:]
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_other_dtypes_use_torch():
    logits = torch.randn(3, 40).to(torch.bfloat16)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_the_kernel_rejects_an_out_of_the_wrong_length():
    with pytest.raises(ValueError, match="out 3 elements"):
        _core.cpu_argmax(np.zeros((2, 8), np.float32), np.zeros(3, np.int64), 1)
