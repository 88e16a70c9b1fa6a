"""The scheduler's side of structured output, through the bindings: a request whose grammar
compiles waits in place without blocking those behind it, is admitted after `grammar_ready`,
its samples are listed in `structured_output_samples`, and an abort (a failed compile) frees
it."""

from __future__ import annotations

import pytest

from scheduler_util import STRATEGIES, all_blocks_free, make, prompt, step


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_compiling_request_waits_while_others_run(scheduling):
    s = make(num_gpu_blocks=64, scheduling=scheduling)
    s.add_request("so", prompt(0, 5), n=2, max_tokens=3, structured_output=True)
    s.add_request("free", prompt(1, 5), max_tokens=3)
    out, _ = step(s)
    assert s.waiting_ids() == ["so"]
    assert out.sample_request_ids == ["free"]
    assert out.structured_output_samples.tolist() == []
    assert s.grammar_ready("so") is True
    out, _ = step(s)
    assert s.waiting_ids() == []
    ids = out.sample_request_ids
    assert out.structured_output_samples.tolist() == [k for k, r in enumerate(ids) if r == "so"]
    assert len(out.structured_output_samples) == 2


def test_grammar_ready_refuses_a_request_without_structured_output():
    s = make(num_gpu_blocks=16)
    s.add_request("free", prompt(0, 4))
    with pytest.raises(ValueError, match="without structured_output"):
        s.grammar_ready("free")
    assert s.grammar_ready("unknown") is False


def test_aborting_a_compiling_request_leaves_nothing_behind():
    s = make(num_gpu_blocks=16)
    s.add_request("so", prompt(0, 4), structured_output=True)
    s.add_request("free", prompt(1, 4), max_tokens=2)
    step(s)
    s.abort_request("so")
    assert s.grammar_ready("so") is False
    while s.has_unfinished_requests():
        step(s)
    assert s.get_stats()["num_aborted"] == 1
    assert all_blocks_free(s)
