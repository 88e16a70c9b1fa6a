"""The stop-token set of a request (EOS ids and stop ids), built once and used by the scheduler's
stop rule, the output text and the sampler's min_tokens mask alike."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import EngineArgs, LLMEngine, SamplingParams
from pagedllm.engine.request import StopTokens

from model_factory import save_tiny_checkpoint

EOS_IDS = (1, 7, 9)  # Llama 3 style: generation_config.json lists several EOS ids
MIN_TOKENS = 4


def test_stop_tokens_of_a_several_eos_checkpoint_hold_every_eos_id():
    stop = StopTokens.of(SamplingParams(stop_token_ids=[5]), EOS_IDS)
    assert stop.eos_token_id == 1
    assert stop.stop_token_ids == [5, 7, 9]
    assert stop.ids == {1, 5, 7, 9}


def test_stop_tokens_with_ignore_eos_hold_only_the_stop_ids():
    stop = StopTokens.of(SamplingParams(stop_token_ids=[5], ignore_eos=True), EOS_IDS)
    assert (stop.eos_token_id, stop.stop_token_ids, stop.ids) == (1, [5], {5})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("llama3"), "llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(EOS_IDS)}))
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(folder), device="cpu", block_size=4, num_gpu_blocks=64, max_model_len=64
        )
    )
    # the tests bias the logits through `compute_logits`, which the fused CPU decode (one call from
    # token ids to logits, models/cpu_forward.py) does not go through: layer by layer here
    engine.runner.cpu_forward = None
    return engine


@pytest.mark.parametrize("favoured", EOS_IDS)
def test_several_eos_checkpoint_never_ends_before_min_tokens_via_any_eos_id(engine, favoured):
    # the model is made to prefer one EOS id above everything, then the other EOS ids
    bonus = torch.zeros(engine.model_config.vocab_size)
    for rank, eos in enumerate(sorted(EOS_IDS, key=lambda t: t != favoured)):
        bonus[eos] = 1000.0 - 100.0 * rank
    compute_logits = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: compute_logits(hidden) + bonus
    try:
        params = SamplingParams(temperature=0.0, min_tokens=MIN_TOKENS, max_tokens=16)
        engine.add_request(f"r{favoured}", "hello world", params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
    finally:
        del engine.model.compute_logits
    (completion,) = final.outputs
    assert not set(completion.token_ids[:MIN_TOKENS]) & set(EOS_IDS)
    assert completion.token_ids[MIN_TOKENS:] == [favoured]
    assert completion.finish_reason == "stop"


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_id_ends_the_text_before_its_own_unless_kept(engine, keep):
    # the scheduler says which token ends a sequence by itself (Scheduler.stop_cuts), before
    # any text is appended: its text is left out unless include_stop_str_in_output
    stop_id = next(t for t in range(32, 127) if t not in EOS_IDS)
    piece = engine.tokenizer.decode([stop_id])
    bonus = torch.zeros(engine.model_config.vocab_size)
    bonus[stop_id] = 1000.0
    compute_logits = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: compute_logits(hidden) + bonus
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            stop_token_ids=[stop_id],
            include_stop_str_in_output=keep,
        )
        engine.add_request(f"stop-{keep}", [3, 4, 5], params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
    finally:
        del engine.model.compute_logits
    (completion,) = final.outputs
    assert completion.token_ids == [stop_id]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    assert piece and completion.text == (piece if keep else "")
