"""Bad input through the engine: each one gives a clear error or a finished-with-reason
request, and the engine keeps serving the others."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import pagedllm.engine.request as request_module
from pagedllm import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedllm.engine.inputs import InputProcessor
from pagedllm.tokenizer import ByteTokenizer, HFTokenizer

from model_factory import save_tiny_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(
        EngineArgs(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=64, swap_space=0.01)
    )


def run_all(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_empty_prompt_is_rejected_naming_the_request(engine):
    with pytest.raises(ValueError, match="'empty-1'.*empty prompt"):
        engine.add_request("empty-1", {"prompt_token_ids": []}, GREEDY)
    assert not engine.has_unfinished_requests()


def test_token_id_outside_the_vocabulary_is_rejected(engine):
    with pytest.raises(ValueError, match="'oov'.*token id 100000.*vocabulary"):
        engine.add_request("oov", {"prompt_token_ids": [1, 2, 100000]}, GREEDY)
    with pytest.raises(ValueError, match="'neg'.*token id -1"):
        engine.add_request("neg", {"prompt_token_ids": [-1]}, GREEDY)
    assert not engine.has_unfinished_requests()


def test_prompt_longer_than_max_model_len_finishes_with_a_reason(engine):
    engine.add_request("too-long", {"prompt_token_ids": [3] * 65}, GREEDY)
    engine.add_request("fine", {"prompt_token_ids": [3] * 10}, GREEDY)
    finished = run_all(engine)
    too_long = finished["too-long"].outputs[0]
    assert too_long.finish_reason == "length" and too_long.token_ids == []
    assert "max_model_len" in str(too_long.stop_reason)
    assert len(finished["fine"].outputs[0].token_ids) == 4


def test_prompt_longer_than_the_whole_kv_cache_finishes_with_a_reason():
    # prefill_first never splits a prompt: one over the token budget can never run
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            device="cpu",
            block_size=4,
            max_model_len=64,
            num_gpu_blocks=16,
            scheduling="prefill_first",
            max_num_batched_tokens=32,
            watermark=0.25,
        )
    )
    engine.add_request("big", {"prompt_token_ids": [3] * 60}, GREEDY)
    engine.add_request("small", {"prompt_token_ids": [3] * 8}, GREEDY)
    finished = run_all(engine)
    assert finished["big"].outputs[0].finish_reason == "length"
    assert finished["big"].outputs[0].stop_reason
    assert len(finished["small"].outputs[0].token_ids) == 4


def test_duplicate_request_id_is_rejected_and_the_first_is_untouched(engine):
    engine.add_request("dup", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(ValueError, match="'dup'.*duplicate"):
        engine.add_request("dup", {"prompt_token_ids": [9, 9]}, GREEDY)
    finished = run_all(engine)
    assert finished["dup"].prompt_token_ids == [1, 2, 3]
    assert len(finished["dup"].outputs[0].token_ids) == 4


def test_abort_of_unknown_or_finished_id_is_a_no_op(engine):
    engine.add_request("done", {"prompt_token_ids": [1, 2]}, GREEDY)
    run_all(engine)
    engine.abort_request("done")
    engine.abort_request(["never-added"])
    assert not engine.has_unfinished_requests()


def test_abort_finishes_a_running_request_and_frees_its_blocks(engine):
    engine.add_request(
        "long",
        {"prompt_token_ids": [1, 2, 3]},
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    )
    engine.add_request("short", {"prompt_token_ids": [4, 5]}, GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("long")
    finished = run_all(engine)
    assert finished["long"].outputs[0].finish_reason == "abort"
    assert len(finished["short"].outputs[0].token_ids) == 4
    stats = engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def test_invalid_sampling_params_fail_at_construction():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_missing_model_folder_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(missing), device="cpu")


def test_malformed_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu")


def test_kv_cache_too_small_for_one_sequence_fails_at_start_up():
    with pytest.raises(ValueError, match=r"needs 16 blocks.*only 10"):
        LLM(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=10)


def test_unknown_engine_argument_is_rejected():
    with pytest.raises(TypeError, match="blok_size"):
        LLM(device="cpu", blok_size=4)


# ---- bounds before allocation, strict inputs (issue 8, items 3 and 4) -------------------------


def assert_refused(engine, request_id, prompt, params=GREEDY, *, error=ValueError, match, **kw):
    """The request is refused with `error` naming it; nothing is queued and the engine still
    serves a good request."""
    before = engine.get_num_unfinished_requests()
    with pytest.raises(error, match=match) as info:
        engine.add_request(request_id, prompt, params, **kw)
    if isinstance(request_id, str):
        assert repr(request_id) in str(info.value)
    assert engine.get_num_unfinished_requests() == before
    assert not engine.has_unfinished_requests() and request_id not in engine.requests
    engine.add_request("after", {"prompt_token_ids": [1, 2]}, GREEDY)
    assert len(run_all(engine)["after"].outputs[0].token_ids) == 4


def test_logprobs_above_the_vocabulary_size_is_rejected_naming_the_limit(engine):
    vocab = engine.model_config.vocab_size
    assert_refused(
        engine,
        "lp",
        [1, 2],
        SamplingParams(logprobs=vocab + 1),
        match=f"logprobs={vocab + 1} exceeds the vocabulary size {vocab}",
    )


def test_logprobs_equal_to_the_vocabulary_size_runs(engine):
    vocab = engine.model_config.vocab_size
    engine.add_request("lp-all", [1, 2], SamplingParams(logprobs=vocab, max_tokens=1))
    out = run_all(engine)["lp-all"].outputs[0]
    assert len(out.token_ids) == 1 and len(out.logprobs[0]) >= vocab


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", {"n": 2**40}),
        ("n", {"n": 10**8}),
        ("n", {"n": 257}),
        ("best_of", {"n": 1, "best_of": 2**40}),
        ("best_of", {"n": 2, "best_of": 10**8}),
    ],
    ids=repr,
)
def test_n_or_best_of_above_max_num_seqs_is_rejected_before_any_sequence_is_built(
    engine, monkeypatch, field, kwargs
):
    def no_sequence(*args, **kw):
        raise AssertionError("a per-sequence object was built")

    with monkeypatch.context() as patch:
        patch.setattr(request_module, "SequenceState", no_sequence)
        with pytest.raises(
            ValueError, match=f"'many'.*{field}={kwargs[field]} exceeds max_num_seqs=256"
        ):
            engine.add_request("many", [1, 2], SamplingParams(**kwargs))
    assert_refused(engine, "many", [1, 2], SamplingParams(**kwargs), match="max_num_seqs=256")


def test_n_equal_to_max_num_seqs_runs():
    engine = LLMEngine.from_engine_args(
        EngineArgs(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=64, max_num_seqs=3)
    )
    engine.add_request("three", [1, 2], SamplingParams(n=3, max_tokens=2))
    assert len(run_all(engine)["three"].outputs) == 3


def test_priority_beyond_int64_is_rejected_naming_field_and_limit(engine):
    assert_refused(
        engine,
        "prio",
        [1, 2],
        priority=2**70,
        match=r"priority must be <= 9223372036854775807, got 1180591620717411303424",
    )


def test_non_integer_priority_or_bad_arrival_time_is_rejected(engine):
    assert_refused(engine, "prio-f", [1, 2], priority=1.5, match="priority")
    assert_refused(engine, "arrival", [1, 2], arrival_time="now", match="arrival_time")


def test_sampling_params_pushed_out_of_range_after_construction_are_still_refused(engine):
    params = dataclasses.replace(GREEDY)
    params.max_tokens = 2**64  # dataclass fields can be reassigned past validation
    before = engine.get_num_unfinished_requests()
    with pytest.raises(ValueError, match=r"max_tokens must be <= 9223372036854775807") as info:
        engine.add_request("mutated", [1, 2], params)
    assert "mutated" in str(info.value)
    assert engine.get_num_unfinished_requests() == before and "mutated" not in engine.requests


@pytest.mark.parametrize(
    "ids, where",
    [
        ([72.9, 105.9], r"\[0\] must be an int, got float 72.9"),
        (["5"], r"\[0\] must be an int, got str '5'"),
        ([5, True], r"\[1\] must be an int, got bool True"),
        ([1, None], r"\[1\] must be an int, got NoneType None"),
        ([1, float("nan")], r"\[1\] must be an int, got float nan"),
        ("hello", "must be a list of ints or an integer numpy array, got str"),
        (np.array([72.9, 105.9]), "1-D integer array, got a 1-D float64 ndarray"),
        (np.array([True, False]), "1-D integer array, got a 1-D bool ndarray"),
        (np.array([[1, 2]]), "1-D integer array, got a 2-D int64 ndarray"),
        (torch.tensor([1.5, 2.0]), "1-D integer array, got a 1-D torch.float32 Tensor"),
        (None, "got NoneType"),
    ],
    ids=repr,
)
def test_prompt_token_ids_that_are_not_integers_are_refused_not_truncated(engine, ids, where):
    assert_refused(engine, "ids", {"prompt_token_ids": ids}, match=r"prompt_token_ids.*" + where)


def test_a_token_list_prompt_of_floats_is_refused(engine):
    assert_refused(engine, "flat", [1.0, 2.0], match=r"prompt_token_ids\[0\] must be an int")


@pytest.mark.parametrize(
    "ids",
    [
        np.array([5, 6, 7], dtype=np.int32),
        np.array([5, 6, 7], dtype=np.uint16),
        [np.int64(5), 6, np.uint8(7)],
        (5, 6, 7),
        torch.tensor([5, 6, 7]),
    ],
    ids=repr,
)
def test_integer_token_ids_of_any_integer_type_are_accepted(engine, ids):
    engine.add_request("ints", {"prompt_token_ids": ids}, GREEDY)
    out = run_all(engine)["ints"]
    assert out.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in out.prompt_token_ids)
    assert len(out.outputs[0].token_ids) == 4


def test_lone_surrogate_text_prompt_is_rejected_naming_the_request(engine):
    assert_refused(
        engine,
        "surrogate",
        "hello \ud800 world",
        match=r"prompt is not valid Unicode text: lone surrogate '\\ud800' at position 6",
    )


def test_request_id_must_be_a_str(engine):
    with pytest.raises(TypeError, match="request_id must be a str, got int 5"):
        engine.add_request(5, [1, 2], GREEDY)
    assert not engine.has_unfinished_requests() and not engine.requests


def test_abort_takes_a_str_or_an_iterable_of_str(engine):
    engine.add_request("keep", [1, 2], GREEDY)
    with pytest.raises(TypeError, match=r"abort_request takes a request id \(str\).*got int 5"):
        engine.abort_request(5)
    with pytest.raises(TypeError, match="request id must be a str, got int 5"):
        engine.abort_request(["keep", 5])  # refused as a whole: "keep" is not aborted
    finished = run_all(engine)
    assert finished["keep"].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_the_size_bound_of_a_text_prompt_never_exceeds_its_token_count(kind, tmp_path):
    # the server refuses a text by this bound before tokenizing it: it must never overcount
    if kind == "byte":
        tokenizer = ByteTokenizer()
    else:
        save_tiny_tokenizer(tmp_path)
        tokenizer = HFTokenizer(tmp_path)
    inputs = InputProcessor(tokenizer, vocab_size=tokenizer.vocab_size)
    texts = ["x" * 5000, " " * 5000, "the cat " * 700, "é" * 3000, "e\u0301" * 2000, "<s>" * 900]
    for text in texts:
        bound = inputs.min_prompt_tokens(text)
        assert 0 < bound <= len(tokenizer.encode(text)), text[:10]
