"""SPEC §6 through the engine: each bad input gives a clear error or a finished-with-reason
request, and the engine keeps serving the others."""
from __future__ import annotations

import json

import pytest

from pagedllm import EngineArgs, LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(EngineArgs(device="cpu", block_size=4, max_model_len=64,
                                                 num_gpu_blocks=64, swap_space=0.01))


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
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", block_size=4, max_model_len=64,
                                                   num_gpu_blocks=16, scheduling="prefill_first",
                                                   max_num_batched_tokens=32, watermark=0.25))
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
    engine.add_request("long", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
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
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu")


def test_kv_cache_too_small_for_one_sequence_fails_at_start_up():
    with pytest.raises(ValueError, match=r"needs 16 blocks.*only 10"):
        LLM(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=10)


def test_unknown_engine_argument_is_rejected():
    with pytest.raises(TypeError, match="blok_size"):
        LLM(device="cpu", blok_size=4)
