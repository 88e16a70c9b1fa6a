"""The scheduler's Python API: arguments, the step arrays, feedback, abort, stats, delay."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import _core
from pagedllm._core import PagedLLMError, Scheduler, SchedulerOutput

from scheduler_util import all_blocks_free, make, prompt, step


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"scheduling": "fastest"}, "scheduling"),
        ({"policy": "lifo"}, "policy"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"delay_factor": -1.0}, "delay_factor"),
    ],
)
def test_bad_configuration_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make(num_gpu_blocks=8, **kwargs)


def test_constructor_defaults_are_readable_back():
    s = Scheduler(num_gpu_blocks=8)
    assert (s.block_size, s.max_num_seqs, s.max_model_len) == (16, 256, 2048)
    assert (s.scheduling, s.policy, s.preemption_mode) == ("unified", "fcfs", None)
    assert s.max_num_batched_tokens == 8192
    assert (
        Scheduler(
            num_gpu_blocks=8, scheduling="prefill_first", max_model_len=4096
        ).max_num_batched_tokens
        == 4096
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_token_ids": []}, "empty prompt"),
        ({"prompt_token_ids": [1, -2]}, r"prompt token id -2 \(position 1\) is outside"),
        ({"n": 0}, "n must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"stop_token_ids": [3, 2**40]}, "stop token"),
    ],
)
def test_bad_request_is_a_value_error_naming_the_request(kwargs, message):
    s = make(num_gpu_blocks=8)
    args = {"prompt_token_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message) as info:
        s.add_request("req-7", args.pop("prompt_token_ids"), **args)
    assert "req-7" in str(info.value)
    assert not s.has_unfinished_requests()


def assert_nothing_queued_and_a_good_request_runs(s):
    assert not s.has_unfinished_requests() and s.request_status("req-7") is None
    s.add_request("good", [1, 2, 3], max_tokens=1)
    out, finished = step(s)
    assert out.request_ids == ["good"] and finished[0][:3] == ("good", 0, "length")
    assert all_blocks_free(s)


@pytest.mark.parametrize("n", [5, 2**40, 2**70])
def test_n_above_max_num_seqs_is_rejected_before_allocation(n):
    s = make(num_gpu_blocks=8, max_num_seqs=4)
    # 2**40 sequences used to be allocated first and abort the process
    with pytest.raises(ValueError, match=f"n={n} exceeds max_num_seqs=4") as info:
        s.add_request("req-7", [1, 2, 3], n=n)
    assert "req-7" in str(info.value)
    assert_nothing_queued_and_a_good_request_runs(s)


def test_n_equal_to_max_num_seqs_is_accepted():
    s = make(num_gpu_blocks=16, max_num_seqs=4)
    s.add_request("a", [1, 2, 3], n=4)
    out, _ = step(s)
    assert out.num_samples == 4


@pytest.mark.parametrize(
    "field, value, limit",
    [
        ("max_tokens", 2**63, 2**63 - 1),
        ("max_tokens", 2**64, 2**63 - 1),
        ("min_tokens", 2**63, 2**63 - 1),
        ("priority", 2**70, 2**63 - 1),
        ("priority", -(2**70), -(2**63)),
        ("extra_key", 2**64, 2**64 - 1),
        ("extra_key", -1, 0),
        ("eos_token_id", 2**40, 2**32 - 1),
    ],
    ids=repr,
)
def test_integer_argument_out_of_range_names_request_field_and_limit(field, value, limit):
    s = make(num_gpu_blocks=8)
    with pytest.raises(ValueError, match=field) as info:  # not a bare OverflowError
        s.add_request("req-7", [1, 2, 3], **{field: value})
    assert "req-7" in str(info.value) and str(limit) in str(info.value)
    assert_nothing_queued_and_a_good_request_runs(s)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 1.5),
        ("n", True),
        ("max_tokens", 3.0),
        ("priority", "1"),
        ("eos_token_id", 2.0),
    ],
    ids=repr,
)
def test_non_integer_argument_is_refused_not_truncated(field, value):
    s = make(num_gpu_blocks=8)
    with pytest.raises(ValueError, match=f"{field} must be an int") as info:
        s.add_request("req-7", [1, 2, 3], **{field: value})
    assert "req-7" in str(info.value)
    assert_nothing_queued_and_a_good_request_runs(s)


@pytest.mark.parametrize(
    "ids, where",
    [
        ([72.9, 105.9], r"\[0\].*float 72.9"),
        (["5"], r"\[0\].*str"),
        ([True, 1], r"\[0\].*bool"),
        ([1, True], r"\[1\].*bool"),
        ([1, None], r"\[1\].*None"),
        ([1, float("nan")], r"\[1\].*nan"),
        ((1, 2.5), r"\[1\].*float"),
        ([1, 2**70], r"\[1\].*out of range"),
        (np.array([72.9, 105.9]), "1-D integer array, got a 1-D float64 ndarray"),
        (np.array([True, False]), "1-D integer array, got a 1-D bool ndarray"),
        (np.array([2**64 - 1], dtype=np.uint64), "out of range"),
        ("hello", "got str"),
        (5, "got int"),
        (np.array([[1, 2]]), "1-D integer array, got a 2-D int64 ndarray"),
    ],
    ids=repr,
)
def test_prompt_ids_that_are_not_integers_are_refused(ids, where):
    s = make(num_gpu_blocks=8)
    with pytest.raises(ValueError, match="prompt_token_ids.*" + where) as info:
        s.add_request("req-7", ids)
    assert "req-7" in str(info.value)
    assert_nothing_queued_and_a_good_request_runs(s)


@pytest.mark.parametrize("ids", [[5, 1.5], [True], np.array([5.0])], ids=repr)
def test_stop_token_ids_that_are_not_integers_are_refused(ids):
    s = make(num_gpu_blocks=8)
    with pytest.raises(ValueError, match="stop_token_ids") as info:
        s.add_request("req-7", [1, 2, 3], stop_token_ids=ids)
    assert "req-7" in str(info.value)
    assert_nothing_queued_and_a_good_request_runs(s)


def test_numpy_integer_scalars_are_accepted_as_ints():
    s = make(num_gpu_blocks=16)
    s.add_request(
        "a",
        [np.int32(5), np.uint16(6), 7],
        n=np.int64(2),
        max_tokens=np.uint8(1),
        priority=np.int8(-1),
        eos_token_id=np.int64(2),
        stop_token_ids=(np.int16(3),),
    )
    out, finished = step(s)
    assert out.input_ids.tolist() == [5, 6, 7] and out.num_samples == 2
    assert [f[4] for f in finished] == [False, True]


@pytest.mark.parametrize("sampled", [np.array([7.9]), [7.9], np.array([True]), [True]], ids=repr)
def test_sampled_tokens_must_be_integers(sampled):
    s = make(num_gpu_blocks=8)
    s.add_request("a", [1, 2, 3], max_tokens=4)
    out = s.schedule()
    with pytest.raises(ValueError, match="sampled_token_ids"):
        s.update_from_output(out, sampled)
    s.update_from_output(out, np.array([7]))  # the step was not applied: it still takes samples
    out, _ = step(s)
    assert out.input_ids.tolist() == [7]


@pytest.mark.parametrize("request_id", [5, None, b"a"], ids=repr)
def test_request_id_must_be_a_str(request_id):
    s = make(num_gpu_blocks=8)
    with pytest.raises(TypeError, match="request_id must be a str"):
        s.add_request(request_id, [1, 2, 3])
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("arg", [5, None, ["a", 5]], ids=repr)
def test_abort_takes_a_str_or_an_iterable_of_str(arg):
    s = make(num_gpu_blocks=8)
    s.add_request("a", [1, 2, 3])
    with pytest.raises(TypeError, match=r"abort_request takes a request id \(str\)"):
        s.abort_request(arg)
    assert s.waiting_ids() == ["a"]  # nothing aborted, not even the valid ids before the bad one
    s.abort_request(("a",))
    assert not s.has_unfinished_requests()


def test_duplicate_id_leaves_the_first_request_untouched():
    s = make(num_gpu_blocks=8)
    s.add_request("a", [1, 2, 3], max_tokens=4)
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request("a", [9, 9])
    out, _ = step(s)
    assert out.input_ids.tolist() == [1, 2, 3]


def test_prompt_as_numpy_array_of_any_int_dtype():
    s = make(num_gpu_blocks=8)
    s.add_request("a", np.array([5, 6, 7], dtype=np.int32))
    s.add_request("b", np.array([8, 9], dtype=np.uint16))
    out, _ = step(s)
    assert out.input_ids.tolist() == [5, 6, 7, 8, 9]


def test_step_arrays_follow_the_contract():
    s = make(num_gpu_blocks=32, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    s.add_request("a", prompt(0, 7), n=2)
    s.add_request("b", prompt(1, 3))
    for _ in range(4):
        out = s.schedule()
        assert isinstance(out, SchedulerOutput)
        S, T, K = out.num_seqs, out.num_batched_tokens, out.num_samples
        for name, dtype, shape in [
            ("seq_ids", np.int64, (S,)),
            ("seq_index", np.int32, (S,)),
            ("num_tokens", np.int32, (S,)),
            ("start_pos", np.int32, (S,)),
            ("seq_lens", np.int32, (S,)),
            ("query_start_loc", np.int32, (S + 1,)),
            ("input_ids", np.int64, (T,)),
            ("positions", np.int64, (T,)),
            ("slot_mapping", np.int64, (T,)),
            ("sample_rows", np.int64, (K,)),
            ("sample_seq_ids", np.int64, (K,)),
            ("sample_seq_index", np.int32, (K,)),
        ]:
            arr = getattr(out, name)
            assert arr.dtype == dtype and arr.shape == shape, name
            assert arr.flags.writeable, name
        assert out.block_tables.dtype == np.int32 and out.block_tables.shape[0] == S
        assert out.seq_lens.tolist() == (out.start_pos + out.num_tokens).tolist()
        assert out.query_start_loc.tolist() == [0, *np.cumsum(out.num_tokens).tolist()]
        assert len(out.request_ids) == S and len(out.sample_request_ids) == K
        # every token's slot is its position's block in the table, and positions are in order
        for row in range(S):
            lo, hi = out.query_start_loc[row], out.query_start_loc[row + 1]
            pos = out.positions[lo:hi]
            assert pos.tolist() == list(range(out.start_pos[row], out.seq_lens[row]))
            table = out.block_tables[row]
            assert out.slot_mapping[lo:hi].tolist() == (table[pos // 4] * 4 + pos % 4).tolist()
        assert out.request_ids is out.request_ids  # cached: built once
        s.update_from_output(out, np.arange(K, dtype=np.int64) + 10)
        s.check_invariants()


def test_sampled_tokens_as_list_or_other_int_dtypes():
    s = make(num_gpu_blocks=16)
    s.add_request("a", prompt(0, 4), n=3)
    out = s.schedule()
    s.update_from_output(out, [11, 12, 13])
    out = s.schedule()
    assert sorted(out.input_ids.tolist()) == [11, 12, 13]
    s.update_from_output(out, np.array([1, 2, 3], dtype=np.int32))
    out = s.schedule()
    s.update_from_output(out, np.array([4, 5, 6], dtype=np.uint8))
    s.check_invariants()


def test_feedback_out_of_order_or_malformed_is_refused():
    s = make(num_gpu_blocks=16)
    s.add_request("a", prompt(0, 4), max_tokens=8)
    first = s.schedule()
    with pytest.raises(PagedLLMError, match="update_from_output"):
        s.schedule()
    with pytest.raises(ValueError, match="1 samples"):
        s.update_from_output(first, np.array([1, 2]))
    with pytest.raises(ValueError, match="not a valid token id"):
        s.update_from_output(first, np.array([-5]))
    s.update_from_output(first, np.array([1]))
    with pytest.raises(PagedLLMError, match="already applied"):
        s.update_from_output(first, np.array([1]))
    second = s.schedule()
    with pytest.raises(PagedLLMError, match="not the latest"):
        s.update_from_output(first, np.array([1]))
    s.update_from_output(second, np.array([1]))


def test_stop_string_hit_finishes_as_stopped():
    s = make(num_gpu_blocks=16)
    s.add_request("a", prompt(0, 4), n=2, max_tokens=8)
    out = s.schedule()
    finished = s.update_from_output(out, [3, 4], stop_string_hit=[False, True])
    assert finished == [("a", 1, "stop", None, False)]
    out = s.schedule()
    assert out.num_seqs == 1
    assert s.update_from_output(out, [5], np.array([True])) == [("a", 0, "stop", None, True)]
    assert all_blocks_free(s)


def test_abort_from_every_queue_frees_everything():
    s = make(num_gpu_blocks=3, num_cpu_blocks=4, max_num_batched_tokens=64)
    s.add_request("x", prompt(0, 4), max_tokens=20)
    s.add_request("g", prompt(1, 6), n=2, max_tokens=20)
    step(s)
    step(s)  # x's decode needs a block: the n=2 group is swapped out
    s.add_request("w", prompt(2, 8))
    assert {s.request_status(r) for r in "xgw"} == {"RUNNING", "SWAPPED", "WAITING"}
    s.abort_request(["w", "g"])
    s.abort_request("x")
    s.abort_request("x")  # finished or unknown: no-op
    s.abort_request("never-added")
    s.check_invariants()
    assert not s.has_unfinished_requests()
    assert all_blocks_free(s)
    assert s.get_stats()["num_aborted"] == 3


def test_abort_between_schedule_and_update_skips_its_samples():
    s = make(num_gpu_blocks=16)
    s.add_request("a", prompt(0, 4))
    s.add_request("b", prompt(1, 4))
    out = s.schedule()
    s.abort_request("a")
    assert s.update_from_output(out, [1, 2]) == []
    s.check_invariants()
    assert s.running_ids() == ["b"]


def test_fork_samples_share_the_leader_row():
    s = make(num_gpu_blocks=16)
    s.add_request("solo", prompt(0, 3))
    s.add_request("group", prompt(1, 5), n=3)
    out = s.schedule()
    assert out.num_seqs == 2  # the prompt is computed once
    assert out.sample_rows.tolist() == [0, 1, 1, 1]
    assert out.sample_request_ids == ["solo", "group", "group", "group"]
    assert out.sample_seq_index.tolist() == [0, 0, 1, 2]
    assert len(set(out.sample_seq_ids.tolist())) == 4
    s.update_from_output(out, [1, 2, 3, 4])
    out = s.schedule()
    assert out.num_seqs == 4


def test_request_status_lifecycle_and_queue_readers():
    s = make(num_gpu_blocks=16, max_num_seqs=1)
    s.add_request("a", prompt(0, 4), max_tokens=1)
    s.add_request("b", prompt(1, 4), max_tokens=1)
    assert s.waiting_ids() == ["a", "b"] and s.request_status("a") == "WAITING"
    out = s.schedule()
    assert s.running_ids() == ["a"] and s.request_status("a") == "RUNNING"
    s.update_from_output(out, [1])
    assert s.request_status("a") is None  # finished requests are released
    assert s.num_waiting() == 1 and s.num_running() == 0 and s.num_swapped() == 0


def test_stats_report_queues_usage_cache_and_preemptions_by_mode():
    s = make(num_gpu_blocks=2, max_num_batched_tokens=64)
    s.add_request("a", prompt(0, 4))
    s.add_request("b", prompt(1, 4))
    step(s)
    step(s)
    st = s.get_stats()
    assert st["num_running"] == 1 and st["num_waiting"] == 1 and st["num_swapped"] == 0
    assert st["kv_usage"] == 1.0
    assert st["num_preemptions"] == st["num_preemptions_recompute"] == 1
    assert st["num_preemptions_swap"] == 0
    assert st["prefix_cache_queries"] == 2
    for key in ("prefix_cache_hits", "prefix_cache_hit_rate", "num_steps", "num_free_gpu_blocks"):
        assert key in st


def test_delay_factor_holds_admission_back():
    s = make(num_gpu_blocks=32, scheduling="prefill_first", delay_factor=1.0)
    s.add_request("a", prompt(0, 4), arrival_time=0.0, max_tokens=50)
    out = s.schedule(now=0.0)
    assert out.request_ids == ["a"]
    s.update_from_output(out, [1])
    out = s.schedule(now=1.0)  # the prefill step took 1 s
    s.update_from_output(out, [1])
    s.add_request("b", prompt(1, 4), arrival_time=1.2)
    out = s.schedule(now=1.5)  # b waited 0.3 s < 1.0 x 1 s: decode only
    assert out.request_ids == ["a"]
    s.update_from_output(out, [1])
    out = s.schedule(now=2.5)  # waited 1.3 s: admitted
    assert out.request_ids == ["b"]


def test_lookahead_slots_are_allocated():
    s = make(num_gpu_blocks=16, num_lookahead_slots=4)
    s.add_request("a", prompt(0, 4))
    out, _ = step(s)
    assert out.block_tables.shape == (1, 2)  # 4 tokens + 4 lookahead slots


def test_repr_is_informative():
    s = make(num_gpu_blocks=8)
    s.add_request("a", prompt(0, 4))
    out = s.schedule()
    assert "unified" in repr(s) and "num_seqs=1" in repr(out)


# ---- the request rules, asked without queuing (issue 22: one owner per rule) ------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_token_ids": []}, "empty prompt"),
        ({"n": 5}, r"n=5 exceeds max_num_seqs=4 \(the most sequences one request may have\)"),
        ({"best_of": 2**70}, f"best_of={2**70} exceeds max_num_seqs=4"),
        ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
        ({"arrival_time": float("inf")}, "arrival_time must be a finite number of seconds"),
        ({"arrival_time": "now"}, "arrival_time must be None or a number of seconds, got str"),
        ({"lora_id": 3}, "lora_id=3 given but LoRA is not enabled"),
        ({"prompt_token_ids": [1, 2.5]}, r"prompt_token_ids\[1\] must be an int, got float"),
    ],
    ids=repr,
)
def test_validate_request_refuses_as_add_request_does_and_queues_nothing(kwargs, message):
    s = make(num_gpu_blocks=8, max_num_seqs=4)
    args = {"prompt_token_ids": [1, 2, 3], **kwargs}
    ids = args.pop("prompt_token_ids")
    with pytest.raises(ValueError, match=message) as validated:
        s.validate_request("req-7", ids, **args)
    with pytest.raises(ValueError) as added:
        s.add_request("req-7", ids, **args)
    assert str(validated.value) == str(added.value)
    assert str(validated.value).startswith("request 'req-7': ")
    assert_nothing_queued_and_a_good_request_runs(s)


def test_validate_request_returns_the_prompt_as_ints_and_has_no_side_effect():
    s = make(num_gpu_blocks=8)
    ids = s.validate_request("a", np.array([5, 6, 7], dtype=np.uint16), n=2)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)
    assert not s.has_unfinished_requests() and s.request_status("a") is None
    s.add_request("a", ids)
    with pytest.raises(ValueError, match="'a': duplicate request id"):
        s.validate_request("a", ids)


def test_best_of_sets_the_sequences_a_request_runs():
    s = make(num_gpu_blocks=16, max_num_seqs=4)
    s.add_request("a", [1, 2, 3], n=1, best_of=3)
    out, _ = step(s)
    assert out.num_samples == 3


def test_request_id_list_is_abort_requests_rule():
    assert _core.request_id_list("a") == ["a"]
    assert _core.request_id_list(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match=r"abort_request takes a request id \(str\).*got int 5"):
        _core.request_id_list(5)
    with pytest.raises(TypeError, match="item 1: request id must be a str, got int 5"):
        _core.request_id_list(["a", 5])


# ---- the stop rule, asked before the text (a token is a run of one) ---------------------------


def test_stop_cuts_of_single_tokens_say_which_token_ends_its_sequence():
    s = make(num_gpu_blocks=16)
    s.add_request("eos", [1, 2, 3], eos_token_id=2, min_tokens=1, max_tokens=8)
    s.add_request("stop", [4, 5, 6], stop_token_ids=[9], max_tokens=8)
    s.add_request("len", [7, 8], eos_token_id=2, max_tokens=1)
    out = s.schedule()
    assert out.request_ids == ["eos", "stop", "len"]
    sampled = np.array([2, 9, 3])
    kept, by_token = s.stop_cuts(out, sampled)
    # EOS and the stop id end their sequences by themselves (min_tokens=1 is out with the
    # first token); max_tokens ends the third, whose token is not a stop token
    assert kept.tolist() == [1, 1, 1] and by_token.tolist() == [True, True, False]
    assert s.stop_cuts(out, sampled, np.ones(3, dtype=np.int64))[1].tolist() == [True, True, False]
    finished = s.update_from_output(out, sampled)
    assert [(f[0], f[2], f[3]) for f in finished] == [
        ("eos", "stop", None),
        ("stop", "stop", 9),
        ("len", "length", None),
    ]


def test_stop_cuts_hold_eos_back_until_min_tokens():
    s = make(num_gpu_blocks=16)
    s.add_request("a", [1, 2, 3], eos_token_id=2, min_tokens=2, max_tokens=8)
    out = s.schedule()
    assert s.stop_cuts(out, [2])[1].tolist() == [False]
    assert s.update_from_output(out, [2]) == []
    out = s.schedule()
    assert s.stop_cuts(out, [2])[1].tolist() == [True]


# ---- the knobs' rules and defaults ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"delay_factor": float("nan")}, "delay_factor must be a finite number >= 0, got NaN"),
        ({"watermark": 1.0}, r"watermark must be in \[0, 1\), got 1"),
        ({"block_size": 0}, "block_size must be > 0, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"scheduling": "fastest"}, "scheduling must be one of"),
    ],
    ids=repr,
)
def test_check_scheduler_config_is_the_constructors_rule(kwargs, message):
    with pytest.raises(ValueError, match=message) as checked:
        _core.check_scheduler_config(**kwargs)
    with pytest.raises(ValueError) as built:
        Scheduler(num_gpu_blocks=8, **kwargs)
    assert str(checked.value) == str(built.value)


def test_check_scheduler_config_refuses_non_integer_knobs():
    with pytest.raises(ValueError, match="max_num_seqs must be an int, got bool True"):
        _core.check_scheduler_config(max_num_seqs=True)
    with pytest.raises(ValueError, match="block_size must be an int, got float 16.0"):
        _core.check_scheduler_config(block_size=16.0)
