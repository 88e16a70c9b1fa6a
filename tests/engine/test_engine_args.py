"""`EngineArgs`: the scheduler's knobs come from the Rust core, so the engine and a bare
`Scheduler` agree on every default and mode name."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm import LLM, EngineArgs, Scheduler, _core
from pagedllm.config import SCHEDULING_STRATEGIES, SERVER_MAX_NUM_BATCHED_TOKENS


def test_engine_args_defaults_are_the_schedulers():
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    # max_model_len is the engine's own: None means the checkpoint's max_position_embeddings
    shared = set(defaults) & set(_core.DEFAULTS) - {"max_model_len"}
    assert {"block_size", "max_num_seqs", "scheduling", "policy", "preemption_mode"} <= shared
    assert {name: defaults[name] for name in shared} == {n: _core.DEFAULTS[n] for n in shared}
    s = Scheduler(num_gpu_blocks=8)
    assert (s.block_size, s.max_num_seqs, s.scheduling, s.policy, s.preemption_mode) == (
        EngineArgs.block_size,
        EngineArgs.max_num_seqs,
        EngineArgs.scheduling,
        EngineArgs.policy,
        EngineArgs.preemption_mode,
    )


def test_engine_accepts_exactly_the_schedulers_mode_names():
    knobs = {
        "scheduling": _core.SCHEDULING_STRATEGIES,
        "policy": _core.POLICIES,
        "preemption_mode": _core.PREEMPTION_MODES,
    }
    for knob, names in knobs.items():
        assert names, knob
        for name in names:
            EngineArgs(**{knob: name}).validate()
            Scheduler(num_gpu_blocks=8, **{knob: name})
        with pytest.raises(ValueError, match=knob):
            EngineArgs(**{knob: "no-such-mode"}).validate()


def test_default_token_budget_is_the_schedulers():
    for scheduling in SCHEDULING_STRATEGIES:
        for max_model_len in (512, 4096):
            args = EngineArgs(scheduling=scheduling)
            s = Scheduler(num_gpu_blocks=8, scheduling=scheduling, max_model_len=max_model_len)
            assert args.resolved_max_num_batched_tokens(max_model_len) == s.max_num_batched_tokens


def test_server_caps_the_default_budget_where_prompts_are_split():
    for scheduling in SCHEDULING_STRATEGIES:
        for max_model_len in (512, 4096, 16384):
            core = EngineArgs(scheduling=scheduling).resolved_max_num_batched_tokens(max_model_len)
            server = EngineArgs(scheduling=scheduling, usage_context="server")
            expected = core if scheduling == "prefill_first" else min(core, 2048)
            assert server.resolved_max_num_batched_tokens(max_model_len) == expected
    assert SERVER_MAX_NUM_BATCHED_TOKENS == 2048  # vLLM's OpenAI server on CPU


def test_server_budget_gives_way_to_an_explicit_one():
    args = EngineArgs(usage_context="server", max_num_batched_tokens=8192)
    assert args.resolved_max_num_batched_tokens(4096) == 8192


def test_unknown_usage_context_is_refused_by_name():
    with pytest.raises(ValueError, match="usage_context"):
        EngineArgs(usage_context="batch")


@pytest.mark.parametrize(
    "knob, value",
    [
        ("max_model_len", 1),
        ("delay_factor", float("nan")),
        ("watermark", 1.0),
        ("block_size", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("long_prefill_token_threshold", -1),
    ],
    ids=repr,
)
def test_engine_args_refuse_what_the_scheduler_refuses_with_its_message(knob, value):
    # the knobs' rules are the core's: EngineArgs asks them before any model is loaded
    with pytest.raises(ValueError) as built:
        Scheduler(num_gpu_blocks=8, **{knob: value})
    with pytest.raises(ValueError, match=knob) as checked:
        EngineArgs(**{knob: value})
    assert str(checked.value) == str(built.value)


def test_engine_args_refuse_a_non_integer_knob():
    with pytest.raises(ValueError, match="max_num_seqs must be an int, got float 4.0"):
        EngineArgs(max_num_seqs=4.0)


def test_kv_cache_without_room_for_the_watermark_fails_at_start_up():
    # 16 blocks hold one 64-token sequence, but a new sequence never takes the watermark's 4
    assert _core.min_kv_blocks(64, block_size=4, watermark=0.25) == 21
    with pytest.raises(ValueError, match=r"needs 21 blocks of 4 tokens.*only 16"):
        LLM(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=16, watermark=0.25)


def test_only_a_server_engine_counts_as_serving():
    # `serving` is what the token budget asks
    assert EngineArgs(usage_context="server").serving
    assert not EngineArgs().serving
