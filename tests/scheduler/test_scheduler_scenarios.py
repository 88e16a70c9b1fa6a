"""The scheduler scenarios (strategies, policies, preemption, prefix caching), one test each
(block size 4 unless stated)."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_util import STRATEGIES, all_blocks_free, make, prompt, step


def test_prefill_first_batches_the_prompts_then_decodes_them_together():
    s = make(scheduling="prefill_first", num_gpu_blocks=8, max_num_batched_tokens=64)
    for i in range(4):
        s.add_request(f"r{i}", prompt(i, 4))
    out, _ = step(s)
    assert out.num_batched_tokens == 16
    assert out.num_tokens.tolist() == [4, 4, 4, 4]
    assert not out.is_decode_only
    out, _ = step(s)
    assert out.num_tokens.tolist() == [1, 1, 1, 1]
    assert out.is_decode_only
    assert out.blocks_to_copy.shape == (0, 2)
    assert out.blocks_to_swap_in.shape == (0, 2) and out.blocks_to_swap_out.shape == (0, 2)


def test_prefill_first_runs_a_new_prompt_before_the_decodes():
    s = make(scheduling="prefill_first", num_gpu_blocks=32, max_num_batched_tokens=30)
    s.add_request("decoding", prompt(0, 4), max_tokens=10)
    step(s)
    out, _ = step(s)
    assert out.is_decode_only
    s.add_request("new", prompt(1, 30))
    out, _ = step(s)
    assert out.request_ids == ["new"]
    assert out.num_tokens.tolist() == [30]


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_recompute_preempted_request_recomputes_prompt_and_tokens_when_room_returns(scheduling):
    s = make(scheduling=scheduling, num_gpu_blocks=2, max_num_batched_tokens=64)
    s.add_request("a", prompt(0, 4))
    s.add_request("b", prompt(1, 4))
    out, _ = step(s)
    assert out.num_tokens.tolist() == [4, 4]
    out, _ = step(s)
    assert out.request_ids == ["a"]
    assert out.preempted == ["b"]
    assert s.request_status("b") == "PREEMPTED"
    assert s.get_stats()["num_preemptions_recompute"] == 1
    s.abort_request("a")
    out, _ = step(s)
    assert out.request_ids == ["b"]
    assert out.num_tokens.tolist() == [5]  # its prompt plus the token it had generated
    assert out.start_pos.tolist() == [0]
    assert out.input_ids.tolist() == prompt(1, 4) + [7]


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_max_num_seqs_caps_the_running_requests(scheduling):
    s = make(scheduling=scheduling, num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=2)
    s.add_request("running", prompt(0, 4), max_tokens=10)
    step(s)
    s.add_request("x", prompt(1, 4))
    s.add_request("y", prompt(2, 4))
    out, _ = step(s)
    admitted = {"x", "y"} & set(out.request_ids)
    assert len(admitted) == 1
    assert s.num_running() == 2 and s.num_waiting() == 1


def test_prompt_over_max_model_len_finishes_ignored_while_others_run():
    s = make(num_gpu_blocks=64, max_model_len=16)
    s.add_request("long", prompt(0, 17))
    s.add_request("ok", prompt(1, 8))
    assert s.request_status("long") == "FINISHED_IGNORED"
    out, _ = step(s)
    assert [rid for rid, _ in out.finished] == ["long"]
    assert "longer than max_model_len=16" in out.finished[0][1]
    assert out.request_ids == ["ok"]
    assert out.num_tokens.tolist() == [8]
    assert s.request_status("long") is None
    assert s.get_stats()["num_ignored"] == 1


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_request_that_fits_later_waits_and_one_that_never_fits_finishes(scheduling):
    s = make(scheduling=scheduling, num_gpu_blocks=4, max_num_batched_tokens=64)
    s.add_request("big", prompt(0, 12), max_tokens=2)  # 3 of the 4 blocks
    step(s)
    s.add_request("later", prompt(1, 8))  # 2 blocks: not now
    s.add_request("never", prompt(2, 20))  # 5 blocks: more than the cache
    out, _ = step(s)
    assert [rid for rid, _ in out.finished] == ["never"]
    assert "more than the cache" in out.finished[0][1]
    assert s.request_status("later") == "WAITING"
    assert "later" not in out.request_ids
    while "later" not in out.request_ids:
        out, _ = step(s)
    assert s.request_status("big") is None  # finished, which made room


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_decode_preempts_from_the_tail_until_the_decode_fits(scheduling):
    # A and C hold one block each, the n=2 group B shares one; one block is left, which A's
    # decode takes. B then needs two blocks: C (the tail) goes first, then B itself.
    s = make(scheduling=scheduling, num_gpu_blocks=4, max_num_batched_tokens=64)
    s.add_request("A", prompt(0, 4))
    s.add_request("B", prompt(1, 4), n=2)
    s.add_request("C", prompt(2, 4))
    out, _ = step(s)
    assert out.request_ids == ["A", "B", "C"]
    out, _ = step(s)
    assert out.request_ids == ["A"]
    assert out.num_tokens.tolist() == [1]
    assert out.preempted == ["C", "B"]
    assert s.waiting_ids() == ["B", "C"]  # earlier-ranked first


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_group_of_two_sequences_is_swapped_out_and_back_not_recomputed(scheduling):
    s = make(scheduling=scheduling, num_gpu_blocks=3, num_cpu_blocks=4, max_num_batched_tokens=64)
    s.add_request("X", prompt(0, 4), max_tokens=2)
    s.add_request("G", prompt(1, 6), n=2)  # two blocks, shared by both sequences
    step(s)
    out, finished = step(s)
    assert out.preempted == ["G"]
    assert s.request_status("G") == "SWAPPED"
    stats = s.get_stats()
    assert stats["num_preemptions_swap"] == 1 and stats["num_preemptions_recompute"] == 0
    swap_out = out.blocks_to_swap_out
    assert swap_out.shape == (2, 2)  # each shared block crosses once
    assert ("X", 0, "length", None, True) in finished
    s.add_request("Y", prompt(2, 4))
    back, _ = step(s)
    swap_in = back.blocks_to_swap_in
    assert sorted(swap_in[:, 0].tolist()) == sorted(swap_out[:, 1].tolist())  # the host blocks
    assert swap_in.shape == (2, 2)
    assert set(back.request_ids) == {"G"}  # ahead of the newly arrived prompt
    assert s.request_status("Y") == "WAITING"


def test_forked_sequences_copy_their_shared_last_block_on_write():
    s = make(num_gpu_blocks=8)
    s.add_request("g", prompt(0, 6), n=2)
    out, _ = step(s)
    assert out.sample_rows.tolist() == [0, 0]  # both samples from the prompt's last logits
    assert out.sample_seq_index.tolist() == [0, 1]
    shared_tail = int(out.block_tables[0, 1])
    out, _ = step(s)
    assert out.num_seqs == 2
    assert out.blocks_to_copy.tolist() == [[shared_tail, int(out.block_tables[0, 1])]]
    assert int(out.block_tables[1, 1]) == shared_tail
    assert out.block_tables[0, 0] == out.block_tables[1, 0]  # the full block stays shared


def test_chunked_prefill_splits_a_prompt_over_the_budget_and_decodes_first():
    s = make(scheduling="chunked_prefill", num_gpu_blocks=64, max_num_batched_tokens=64)
    s.add_request("a", prompt(0, 60))
    s.add_request("b", prompt(1, 60))
    out, _ = step(s)
    assert out.num_tokens.tolist() == [60, 4]
    assert out.sample_request_ids == ["a"]  # b's prompt is not complete yet
    out, _ = step(s)
    assert out.request_ids == ["a", "b"]  # the decode comes before the unfinished chunk
    assert out.num_tokens.tolist() == [1, 56]


def test_unified_caps_each_long_prefill_at_the_threshold():
    s = make(
        block_size=16,
        num_gpu_blocks=200,
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=400,
    )
    for i in range(3):
        s.add_request(f"r{i}", prompt(i, 800))
    per_step = [step(s)[0].num_tokens.tolist() for _ in range(3)]
    assert per_step == [[400, 400, 224], [400, 400, 224], [1, 1, 352]]


@pytest.fixture(scope="module")
def stop_rule_outcomes() -> dict[str, tuple]:
    """One batch of requests, each ended by one stop rule: request id -> (reason, stop_reason,
    tokens generated)."""
    s = make(num_gpu_blocks=64)
    s.add_request("eos", prompt(0, 4), eos_token_id=2, max_tokens=10)
    s.add_request("stop_id", prompt(1, 4), stop_token_ids=[9], max_tokens=10)
    s.add_request("capped", prompt(2, 4), max_tokens=3)
    s.add_request("ignore", prompt(3, 4), eos_token_id=2, ignore_eos=True, max_tokens=4)
    s.add_request("min", prompt(4, 4), eos_token_id=2, min_tokens=2, max_tokens=10)
    ids = ["eos", "stop_id", "capped", "ignore", "min"]
    tokens = {
        "eos": [5, 2],
        "stop_id": [9],
        "capped": [5, 5, 5],
        "ignore": [2, 2, 2, 2],
        "min": [2, 2],
    }
    done: dict[str, tuple] = {}
    counts = dict.fromkeys(ids, 0)
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = []
        for rid in out.sample_request_ids:
            sampled.append(tokens[rid][counts[rid]])
            counts[rid] += 1
        for rid, index, reason, stop_reason, request_finished in s.update_from_output(
            out, np.array(sampled, dtype=np.int64)
        ):
            assert index == 0 and request_finished
            done[rid] = (reason, stop_reason, counts[rid])
    return done


@pytest.mark.parametrize(
    "rid, outcome",
    [
        ("eos", ("stop", None, 2)),
        ("stop_id", ("stop", 9, 1)),
        ("capped", ("length", None, 3)),
        ("ignore", ("length", None, 4)),  # EOS ignored until max_tokens
        ("min", ("stop", None, 2)),  # the first EOS came before min_tokens
    ],
    ids=[
        "eos_stops",
        "stop_id_stops_with_the_id",
        "max_tokens_caps",
        "ignore_eos_runs_to_max_tokens",
        "eos_before_min_tokens_is_ignored",
    ],
)
def test_stop_rule_ends_its_request(stop_rule_outcomes, rid, outcome):
    assert stop_rule_outcomes[rid] == outcome


def test_priority_preempts_the_lower_priority_request_when_kv_runs_out():
    s = make(block_size=16, num_gpu_blocks=5, policy="priority", max_num_batched_tokens=256)
    s.add_request("low", prompt(0, 30), priority=1, max_tokens=100)
    for _ in range(4):  # prefill, then decodes at 30, 31, 32: the last takes a third block
        step(s)
    s.add_request("high", prompt(1, 32), priority=0, max_tokens=100)
    out, _ = step(s)
    assert set(out.request_ids) == {"low", "high"}
    assert s.get_stats()["num_free_gpu_blocks"] == 0
    out, _ = step(s)  # high's decode at position 32 needs a third block
    assert out.preempted == ["low"]
    assert out.request_ids == ["high"]
    assert s.request_status("low") == "PREEMPTED"


@pytest.mark.parametrize("scheduling", ["unified", "prefill_first"])
def test_waiting_higher_priority_request_preempts_a_running_one(scheduling):
    s = make(scheduling=scheduling, num_gpu_blocks=4, policy="priority", max_num_batched_tokens=64)
    s.add_request("low", prompt(0, 12), priority=5, max_tokens=50)  # 3 of the 4 blocks
    step(s)
    s.add_request("high", prompt(1, 8), priority=0)  # needs 2 blocks, 1 is free
    out, _ = step(s)
    assert out.preempted == ["low"]
    if scheduling == "prefill_first":  # that step only decodes; the prefill comes next
        out, _ = step(s)
    assert "high" in out.request_ids and "low" not in out.request_ids
    assert s.running_ids() == ["high"] and s.waiting_ids() == ["low"]


def test_prompt_sharing_a_cached_prefix_reuses_its_blocks():
    s = make(num_gpu_blocks=32)
    prefix = prompt(0, 12)  # three full blocks
    s.add_request("first", prefix + [1, 2], max_tokens=3)
    step(s)
    s.add_request("second", prefix + [3, 4], max_tokens=3)
    out, _ = step(s)
    row = out.request_ids.index("second")
    assert out.num_tokens[row] == 2 and out.start_pos[row] == 12
    assert s.num_cached_tokens("second") == 12
    first_tables = out.block_tables[out.request_ids.index("first")]
    assert out.block_tables[row, :3].tolist() == first_tables[:3].tolist()
    stats = s.get_stats()
    assert stats["prefix_cache_hits"] == 3 and stats["prefix_cache_queries"] == 2
    while s.has_unfinished_requests():
        step(s)
    s.add_request("third", prefix + [5], max_tokens=3)
    out, _ = step(s)
    assert out.num_tokens.tolist() == [1]
    assert s.get_stats()["prefix_cache_hits"] == 6


@pytest.mark.parametrize("scheduling", STRATEGIES)
@pytest.mark.parametrize("preemption_mode", [None, "recompute", "swap"])
def test_workload_with_aborts_frees_every_block(scheduling, preemption_mode):
    s = make(
        scheduling=scheduling,
        preemption_mode=preemption_mode,
        num_gpu_blocks=12,
        num_cpu_blocks=8,
        max_num_batched_tokens=32,
        max_model_len=48,
    )
    rng = np.random.default_rng(0)
    for i in range(24):
        s.add_request(
            f"r{i}",
            prompt(i % 3, int(rng.integers(2, 20))),
            n=int(rng.integers(1, 3)),
            max_tokens=int(rng.integers(1, 12)),
            eos_token_id=0,
        )
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, rng.integers(0, 6, out.num_samples))
        s.check_invariants()
        steps += 1
        if steps == 5:
            s.abort_request(["r3", "r7", "r11", "unknown"])
        assert steps < 2000
    assert s.num_waiting() == s.num_running() == s.num_swapped() == 0
    assert all_blocks_free(s)


def _run_swap_workload(s, num_requests: int, n: int) -> dict:
    """Steps a swap-heavy workload to the end, checking after every step that a group swapped
    back in computes its tokens in that same step and that every step computes something."""
    for i in range(num_requests):
        s.add_request(f"r{i}", prompt(i, 40), n=n, max_tokens=150, ignore_eos=True)
    swapped_in = 0
    for _ in range(5000):
        if not s.has_unfinished_requests():
            break
        before = set(s.swapped_ids())
        out, _ = step(s)
        assert out.num_batched_tokens > 0 or out.finished, "a step with work computed nothing"
        back = before.intersection(s.running_ids())
        assert back <= set(out.request_ids), f"{back} swapped in without computing a token"
        swapped_in += len(back)
    assert not s.has_unfinished_requests()
    assert all_blocks_free(s)
    return {"swapped_in": swapped_in, **s.get_stats()}


@pytest.mark.parametrize("scheduling", STRATEGIES)
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("n", [1, 2])
def test_swapped_in_group_computes_in_the_step_it_returns(scheduling, caching, n):
    # 24 blocks of 16 with host room for everything: 5 requests outgrow the pool while
    # decoding, so groups are swapped out and back in many times
    s = make(
        scheduling=scheduling,
        block_size=16,
        num_gpu_blocks=24,
        num_cpu_blocks=200,
        max_model_len=400,
        preemption_mode="swap",
        enable_prefix_caching=caching,
    )
    stats = _run_swap_workload(s, num_requests=5, n=n)
    assert stats["num_preemptions_swap"] > 0 and stats["swapped_in"] > 0
    assert stats["num_ignored"] == 0


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_swap_in_keeps_the_watermark_while_others_run(scheduling):
    # with a watermark the swap-in also counts it, yet every group still finishes
    s = make(
        scheduling=scheduling,
        block_size=16,
        num_gpu_blocks=24,
        num_cpu_blocks=200,
        max_model_len=400,
        preemption_mode="swap",
        watermark=0.1,
    )
    stats = _run_swap_workload(s, num_requests=5, n=2)
    assert stats["swapped_in"] > 0 and stats["num_ignored"] == 0
