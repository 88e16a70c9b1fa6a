"""Step faults (issue 8): a step that fails after scheduling is rolled back and the engine keeps
serving; a fault that belongs to one request ends that request only; nothing leaks or is lost."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import SCHEDULING_STRATEGIES
from pagedllm.engine import LLMEngine
from pagedllm.engine.faults import Group

from model_factory import save_tiny_checkpoint

PROMPTS = ["Hello, my name is", "a", "The quick brown fox jumps over", "0123456789" * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
STRATEGIES = list(SCHEDULING_STRATEGIES)


def make_llm(**kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 256)
    kw.setdefault("swap_space", 0.01)
    kw.setdefault("max_model_len", 128)
    return LLM(device="cpu", block_size=4, **kw)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    outs = make_llm().generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class FlakyForward:
    """Wraps the runner's forward: raises `exc` on the given call numbers (1-based)."""

    def __init__(self, engine: LLMEngine, fail_on: set[int], exc: BaseException):
        self.forward, self.fail_on, self.exc, self.calls = engine.runner.forward, fail_on, exc, 0
        engine.runner.forward = self

    def __call__(self, inputs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise self.exc
        return self.forward(inputs)


def run_to_end(engine: LLMEngine, max_steps: int = 10_000) -> tuple[dict, list[BaseException]]:
    """Steps until nothing is left; returns the final outputs by id and the errors raised."""
    finals, errors = {}, []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - the test counts them
            errors.append(exc)
            continue
        for out in outputs:
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finals, errors


def assert_nothing_leaked(engine: LLMEngine) -> None:
    engine.scheduler.check_invariants()
    stats = engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    assert not engine.requests


@pytest.mark.parametrize("scheduling", STRATEGIES)
@pytest.mark.parametrize("fail_on", [1, 2, 6])
def test_a_forward_that_raises_once_is_rolled_back_and_outputs_are_unchanged(
    scheduling, fail_on, reference
):
    llm = make_llm(scheduling=scheduling, max_num_batched_tokens=64)
    engine = llm.engine
    flaky = FlakyForward(engine, {fail_on}, RuntimeError("CUDA out of memory (injected)"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    finals, errors = run_to_end(engine)
    assert len(errors) == 1 and "injected" in str(errors[0])
    assert any("rolled back" in note for note in errors[0].__notes__)
    assert flaky.calls > fail_on
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    assert engine.scheduler.get_stats()["num_rolled_back_steps"] == 1
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("scheduling", STRATEGIES)
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_faults_under_preemption_lose_nothing(scheduling, preemption_mode, reference):
    # a pool far smaller than the work: preemptions (and swaps) happen around the faults
    llm = make_llm(
        scheduling=scheduling,
        preemption_mode=preemption_mode,
        num_gpu_blocks=32,
        max_num_batched_tokens=64,
        swap_space=0.05,
    )
    engine = llm.engine
    FlakyForward(engine, {3, 11}, RuntimeError("kernel error (injected)"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    finals, errors = run_to_end(engine)
    assert len(errors) == 2  # below MAX_STEP_FAULTS: every request is retried
    assert engine.get_stats()["num_preemptions"] > 0
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    assert_nothing_leaked(engine)


def test_a_request_failing_with_nothing_to_compare_ends_after_the_unattributed_limit():
    llm = make_llm()
    engine = llm.engine
    flaky = FlakyForward(engine, set(range(1, 1000)), RuntimeError("device lost (injected)"))
    engine.add_request("doomed", "Hello", GREEDY)
    finals, errors = run_to_end(engine)
    assert len(errors) == LLMEngine.MAX_UNATTRIBUTED_FAULTS
    out = finals["doomed"].outputs[0]
    assert out.finish_reason == "abort"
    assert "device lost (injected)" in out.stop_reason and "failed steps" in out.stop_reason
    assert_nothing_leaked(engine)
    flaky.fail_on = set()  # the fault goes away: the engine serves again
    engine.add_request("next", "Hello", GREEDY)
    finals, errors = run_to_end(engine)
    assert not errors and finals["next"].outputs[0].finish_reason == "length"


def test_interrupted_generate_raises_and_the_next_generate_starts_clean(reference):
    llm = make_llm()
    flaky = FlakyForward(llm.engine, {2}, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_nothing_leaked(llm.engine)
    assert flaky.calls == 2
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_nothing_leaked(llm.engine)


def test_failed_generate_reraises_once_and_the_engine_keeps_serving(reference):
    llm = make_llm()
    FlakyForward(llm.engine, {1}, RuntimeError("out of memory (injected)"))
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_nothing_leaked(llm.engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_a_request_that_fails_in_the_sampler_ends_alone(fail_sampling_of_seed, reference):
    fail_sampling_of_seed(13)
    llm = make_llm()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.add_request("bad", "Hello", SamplingParams(temperature=1.0, seed=13, max_tokens=4))
    finals, errors = run_to_end(engine)
    assert not errors  # attributed to one request: reported in its output, not raised
    bad = finals["bad"].outputs[0]
    assert bad.finish_reason == "abort" and "injected" in bad.stop_reason
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    assert_nothing_leaked(engine)


def test_a_request_whose_output_processing_fails_ends_alone(reference):
    llm = make_llm()
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.add_request("bad", "Hello", GREEDY)

    def broken_append(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.requests["bad"].seqs[0].detokenizer.append = broken_append
    finals, errors = run_to_end(engine)
    assert not errors
    bad = finals["bad"].outputs[0]
    assert bad.finish_reason == "abort" and "output processing failed" in bad.stop_reason
    assert [finals[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    assert_nothing_leaked(engine)


def test_outputs_owed_by_a_failed_step_come_with_the_next_one():
    llm = make_llm(max_model_len=16)
    engine = llm.engine
    FlakyForward(engine, {1}, RuntimeError("injected"))
    engine.add_request("too-long", {"prompt_token_ids": [65] * 40}, GREEDY)  # ignored at schedule
    engine.add_request("ok", "Hi", SamplingParams(temperature=0.0, max_tokens=3))
    engine.abort_request("ok")
    engine.add_request("ok2", "Hi", SamplingParams(temperature=0.0, max_tokens=3))
    finals, errors = run_to_end(engine)
    assert len(errors) == 1
    assert finals["too-long"].outputs[0].finish_reason == "length"
    assert finals["ok"].outputs[0].finish_reason == "abort"
    assert finals["ok2"].finished
    assert_nothing_leaked(engine)


# ---- finding the request at fault -----------------------------------------------------------

POISON_LEN = 80  # no innocent prompt plus its output gets this long
POISONED = "z" * 90


class PoisonedForward:
    """Wraps the runner's forward: any forward over a sequence of `POISON_LEN` tokens or more
    raises (an out-of-memory on one long prompt), every time."""

    def __init__(self, engine: LLMEngine):
        self.forward, self.calls = engine.runner.forward, 0
        engine.runner.forward = self

    def __call__(self, inputs):
        self.calls += 1
        if inputs[2].max_seq_len >= POISON_LEN:
            raise RuntimeError("CUDA out of memory (injected)")
        return self.forward(inputs)


def assert_innocents_unharmed(finals: dict, reference) -> None:
    for i in range(len(PROMPTS)):
        out = finals[str(i)].outputs[0]
        assert out.finish_reason == "length" and out.token_ids == reference[i], f"request {i}"


def assert_poisoned_ended_alone(out) -> None:
    completion = out.outputs[0]
    assert completion.finish_reason == "abort"
    assert "alone" in completion.stop_reason and "injected" in completion.stop_reason


@pytest.mark.parametrize("scheduling", STRATEGIES)
def test_a_request_whose_forward_always_fails_ends_alone(scheduling, reference):
    engine = make_llm(scheduling=scheduling).engine
    PoisonedForward(engine)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, GREEDY)
    engine.add_request("poisoned", POISONED, GREEDY)
    for i, prompt in enumerate(PROMPTS[2:], start=2):
        engine.add_request(str(i), prompt, GREEDY)
    finals, errors = run_to_end(engine)
    assert errors and all("injected" in str(e) for e in errors)  # step() still re-raises
    assert_poisoned_ended_alone(finals["poisoned"])
    assert_innocents_unharmed(finals, reference)
    assert_nothing_leaked(engine)


def test_three_poisoned_requests_in_one_batch_end_alone(reference):
    engine = make_llm().engine
    PoisonedForward(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"poisoned{i}", POISONED + str(i), GREEDY)
        engine.add_request(str(i), prompt, GREEDY)
    finals, _ = run_to_end(engine)
    for i in range(len(PROMPTS)):
        assert finals[f"poisoned{i}"].outputs[0].finish_reason == "abort"
    assert_innocents_unharmed(finals, reference)
    assert_nothing_leaked(engine)


def test_three_poisoned_requests_in_a_row_end_alone(reference):
    engine = make_llm().engine
    PoisonedForward(engine)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    finals = {}
    for k in range(3):  # each arrives while the innocents run, once the one before has ended
        engine.add_request(f"poisoned{k}", POISONED, GREEDY)
        while f"poisoned{k}" not in finals:
            try:
                outputs = engine.step()
            except RuntimeError:
                continue
            finals.update((o.request_id, o) for o in outputs if o.finished)
        assert_poisoned_ended_alone(finals[f"poisoned{k}"])
    rest, _ = run_to_end(engine)
    finals.update(rest)
    assert_innocents_unharmed(finals, reference)
    assert_nothing_leaked(engine)


def test_a_transient_burst_of_failed_steps_blames_nobody(reference):
    engine = make_llm().engine
    flaky = FlakyForward(engine, set(range(1, 10**6)), RuntimeError("device error (injected)"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    burst = LLMEngine.MAX_UNATTRIBUTED_FAULTS - 1
    for _ in range(burst):
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    flaky.fail_on = set()  # the device recovers
    finals, errors = run_to_end(engine)
    assert not errors
    assert_innocents_unharmed(finals, reference)
    assert_nothing_leaked(engine)


def run_every_request_apart(engine: LLMEngine, monkeypatch) -> None:
    """Every step runs each of its requests as a quarantine group of its own."""

    def groups(step):
        rows_of: dict[str, list[int]] = {}
        for row, request_id in enumerate(step.request_ids):
            rows_of.setdefault(request_id, []).append(row)
        return [
            Group(key, np.array(rows), [request_id])
            for key, (request_id, rows) in enumerate(rows_of.items(), start=1)
        ] or None

    monkeypatch.setattr(engine.faults, "groups", groups)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "kind, engine_kwargs, params",
    [
        ("plain", {}, GREEDY),
        ("n=2", {}, SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)),
        ("ngram", {"speculative_config": NGRAM}, GREEDY),
        ("chunked", {"scheduling": "chunked_prefill", "max_num_batched_tokens": 16}, GREEDY),
    ],
)
def test_requests_run_in_groups_give_the_outputs_of_one_forward(
    kind, engine_kwargs, params, monkeypatch
):
    want = make_llm(**engine_kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(**engine_kwargs)
    run_every_request_apart(llm.engine, monkeypatch)
    forward = FlakyForward(llm.engine, set(), RuntimeError("unused"))
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    assert forward.calls > llm.engine.get_stats()["num_steps"], "steps ran in several forwards"
    if kind == "ngram":
        assert llm.engine.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert_nothing_leaked(llm.engine)


def test_hybrid_kv_requests_run_in_groups_give_the_outputs_of_one_forward(tmp_path, monkeypatch):
    # a sliding-window layer (window 8) has its own KV group: each quarantine group's rows
    # carry their rows of every group's tables and slots
    folder = save_tiny_checkpoint(
        tmp_path, "qwen2", use_sliding_window=True, max_window_layers=1, sliding_window=8
    )
    want = make_llm(model=str(folder)).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = make_llm(model=str(folder))
    assert llm.engine.scheduler.kv_groups == [None, 8]
    run_every_request_apart(llm.engine, monkeypatch)
    forward = FlakyForward(llm.engine, set(), RuntimeError("unused"))
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert forward.calls > llm.engine.get_stats()["num_steps"], "steps ran in several forwards"
    assert_nothing_leaked(llm.engine)
