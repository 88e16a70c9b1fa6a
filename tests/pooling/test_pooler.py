"""Mean and CLS pooling over prefill chunks: a chunk computed again (a rolled-back step, a
request recomputed from position 0 after preemption) replaces its sum, never adds to it."""

from __future__ import annotations

import torch

from pagedllm.pooling.pooler import ChunkSums

FIRST, SECOND = torch.randn(16, 8), torch.randn(5, 8)


def test_mean_over_chunks_equals_the_mean_over_the_prompt():
    sums = ChunkSums("MEAN")
    sums.add("r", 0, FIRST)
    sums.add("r", 16, SECOND)
    assert torch.allclose(sums.pop("r"), torch.cat([FIRST, SECOND]).mean(0), atol=1e-6)


def test_a_recomputed_chunk_replaces_its_sum():
    sums = ChunkSums("MEAN")
    sums.add("r", 0, FIRST)
    sums.add("r", 16, SECOND + 100)  # a step whose results were rolled back
    sums.add("r", 0, FIRST)  # recomputed from the start
    sums.add("r", 16, SECOND)
    assert torch.allclose(sums.pop("r"), torch.cat([FIRST, SECOND]).mean(0), atol=1e-6)


def test_cls_keeps_the_row_of_position_zero():
    sums = ChunkSums("CLS")
    sums.add("r", 0, FIRST)
    sums.add("r", 16, SECOND)
    assert torch.equal(sums.pop("r"), FIRST[0])
