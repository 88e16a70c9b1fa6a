"""The n-gram proposer through the scheduler: one call per step over the token histories the
scheduler holds, for every sequence that decodes next, as arrays."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm._core import PagedLLMError, Scheduler


def scheduler(**spec) -> Scheduler:
    return Scheduler(num_gpu_blocks=64, block_size=4, max_model_len=64, **spec)


def step(s: Scheduler, token: int) -> None:
    out = s.schedule()
    s.update_from_output(out, np.full(out.num_samples, token, dtype=np.int64))


def test_proposes_the_tokens_that_followed_the_suffix_for_the_whole_batch():
    s = scheduler(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    s.add_request("a", [1, 2, 3, 4, 5, 1], max_tokens=16)
    s.add_request("b", [7, 8, 9], max_tokens=16)
    s.add_request("c", [6, 2, 6, 5, 5, 5], max_tokens=16)
    step(s, 2)
    seq_ids, counts, tokens = s.propose_drafts()
    assert seq_ids.dtype == np.int64 and counts.dtype == np.int32 and tokens.dtype == np.int64
    # a: 1 2 3 4 5 1 2 -> [1 2] recurs, then 3 4 5; b: 7 8 9 2 has no repeat;
    # c: 6 2 6 5 5 5 2 -> only [2] recurs (at 1), then 6 5 5
    assert seq_ids.tolist() == [0, 2]
    assert counts.tolist() == [3, 3]
    assert tokens.tolist() == [3, 4, 5, 6, 5, 5]


def test_each_sequence_of_a_request_gets_its_own_drafts():
    s = scheduler(num_speculative_tokens=2, prompt_lookup_max=1, prompt_lookup_min=1)
    s.add_request("a", [3, 1, 3, 2], n=2, max_tokens=16)
    out = s.schedule()
    s.update_from_output(out, np.array([3, 2][: out.num_samples], dtype=np.int64))
    seq_ids, counts, tokens = s.propose_drafts()
    # seq 0: 3 1 3 2 3 -> 3 last seen at 2, then 2 3; seq 1: 3 1 3 2 2 -> 2 at 3, then 2
    assert seq_ids.tolist() == [0, 1]
    assert counts.tolist() == [2, 1]
    assert tokens.tolist() == [2, 3, 2]


def test_nothing_is_proposed_before_the_prompt_is_computed():
    s = scheduler(num_speculative_tokens=2)
    s.add_request("a", [1, 2, 1, 2], max_tokens=8)
    assert [a.tolist() for a in s.propose_drafts()] == [[], [], []]


def test_proposing_without_speculation_is_an_error():
    with pytest.raises(PagedLLMError, match="speculative decoding is off"):
        scheduler().propose_drafts()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 3}, "<="),
    ],
)
def test_bad_proposer_settings_are_value_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        scheduler(**spec)
