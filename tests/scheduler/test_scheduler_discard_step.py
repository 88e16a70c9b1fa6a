"""`Scheduler.discard_step`: a step whose computation failed is taken back; its requests are
recomputed, its swap-outs and prefix-cache registrations undone, and nothing is lost."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import PagedLLMError

from scheduler_util import STRATEGIES, all_blocks_free, make, prompt, step


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_discarded_step_is_recomputed_and_nothing_is_lost(scheduling):
    s = make(scheduling=scheduling, num_gpu_blocks=16, max_num_batched_tokens=64)
    s.add_request("a", prompt(0, 6), max_tokens=3)
    s.add_request("b", prompt(1, 5), max_tokens=3)
    step(s)
    out = s.schedule()  # the decode step "fails"
    assert sorted(s.discard_step(out)) == ["a", "b"]
    s.check_invariants()
    assert s.waiting_ids() == ["a", "b"] and s.running_ids() == []
    out, _ = step(s)  # prompt + the token generated before the fault; the first block of each
    # was computed by the good step, so it is a prefix hit
    rows = sorted(zip(out.request_ids, out.start_pos.tolist(), out.num_tokens.tolist()))
    assert rows == [("a", 4, 3), ("b", 4, 2)]
    while s.has_unfinished_requests():
        step(s)
    assert all_blocks_free(s)
    assert s.get_stats()["num_rolled_back_steps"] == 1
    assert s.get_stats()["num_preemptions"] == 0


def test_schedule_after_a_dropped_output_names_discard_step():
    s = make(num_gpu_blocks=8)
    s.add_request("a", prompt(0, 4))
    s.schedule()
    with pytest.raises(Exception, match="discard_step"):
        s.schedule()


def test_only_the_latest_unapplied_step_can_be_discarded():
    s = make(num_gpu_blocks=8)
    s.add_request("a", prompt(0, 4), max_tokens=4)
    out, _ = step(s)
    with pytest.raises(Exception, match="already applied"):
        s.discard_step(out)
    out = s.schedule()
    s.discard_step(out)
    with pytest.raises(Exception, match="discarded"):
        s.discard_step(out)
    with pytest.raises((ValueError, PagedLLMError)):
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
    s.check_invariants()


def test_discarded_step_forgets_its_prefix_cache_registrations():
    s = make(num_gpu_blocks=8)
    s.add_request("a", prompt(0, 9))
    out = s.schedule()  # registers a's two full prompt blocks, but the forward "fails"
    s.discard_step(out)
    s.abort_request("a")
    s.add_request("b", prompt(0, 9))
    step(s)
    assert s.num_cached_tokens("b") == 0  # never computed, so never a hit
    assert s.get_stats()["prefix_cache_hits"] == 0


def test_discarded_swap_out_becomes_a_recompute():
    s = make(
        scheduling="unified",
        num_gpu_blocks=4,
        num_cpu_blocks=8,
        preemption_mode="swap",
        max_num_batched_tokens=64,
    )
    s.add_request("a", prompt(0, 4), max_tokens=8, ignore_eos=True)
    s.add_request("b", prompt(1, 4), max_tokens=8, ignore_eos=True)
    for _ in range(10):
        out = s.schedule()
        if out.blocks_to_swap_out.shape[0]:
            break
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
    assert out.preempted == ["b"] and s.request_status("b") == "SWAPPED"
    s.discard_step(out)  # the copy to host may never have run
    s.check_invariants()
    assert s.request_status("b") == "PREEMPTED" and s.swapped_ids() == []
    assert s.get_stats()["num_free_cpu_blocks"] == 8
    while s.has_unfinished_requests():
        step(s)
    assert all_blocks_free(s)
