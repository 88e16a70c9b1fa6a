"""The `draft_model` method end to end: a draft identical to the target accepts every greedy
draft; a smaller draft with the target's vocabulary (the target's first layer; or a narrower
model whose KV cache has another shape) leaves greedy outputs unchanged, with prefix caching on
and off, under recompute and swap preemption and for n > 1; no block is leaked; a bad draft
checkpoint is refused at construction."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

import spec_util
from model_factory import save_tiny_checkpoint, save_truncated_checkpoint
from spec_util import assert_ran_clean, token_ids

MAX_NEW = 12
PROMPTS = [
    [5, 17, 99, 3] * 3,
    list(range(20, 41)),
    [7] * 9 + [11, 12, 13],
    [9, 8, 7, 6, 9, 8, 7],
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target folder, smaller draft folder, greedy outputs of the target without speculation);
    the draft is the target's first layer: it agrees with the target on some tokens only."""
    target = save_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=3)
    draft = save_truncated_checkpoint(target, tmp_path_factory.mktemp("draft"), 1)
    _, outs = generate(target, None)
    return target, draft, token_ids(outs)


@pytest.fixture(scope="module")
def narrow_draft(tmp_path_factory):
    """One layer, narrower, fewer KV heads, other weights: a draft cache of another shape."""
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("narrow"),
        "llama",
        seed=5,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def spec(draft, k=3):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


def generate(folder, speculative_config, **kwargs):
    return spec_util.generate(folder, speculative_config, PROMPTS, MAX_NEW, **kwargs)


def test_self_draft_accepts_every_greedy_draft(models):
    target, _, expected = models
    llm, outs = generate(target, spec(target))
    assert token_ids(outs) == expected
    stats = assert_ran_clean(llm)
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_smaller_draft_keeps_greedy_outputs(models, prefix_caching):
    target, draft, expected = models
    llm, outs = generate(target, spec(draft), enable_prefix_caching=prefix_caching)
    assert token_ids(outs) == expected
    assert_ran_clean(llm, accepted=True, rejected=True)


def test_draft_with_another_cache_shape_keeps_greedy_outputs(models, narrow_draft):
    target, _, expected = models
    llm, outs = generate(target, spec(narrow_draft, k=2))
    assert token_ids(outs) == expected
    assert_ran_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_smaller_draft_keeps_greedy_outputs_under_preemption(models, mode):
    target, draft, expected = models
    # 4 requests of up to 24 + 15 tokens in 24 blocks of 4: decodes run out and preempt
    llm, outs = generate(
        target, spec(draft), num_gpu_blocks=24, max_model_len=64, preemption_mode=mode
    )
    assert token_ids(outs) == expected
    stats = assert_ran_clean(llm, accepted=True, rejected=True)
    assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_self_draft_under_preemption_still_accepts_everything(models, mode):
    # the draft's cache follows the target's through recompute and swap: its KV stays exact
    target, _, expected = models
    llm, outs = generate(
        target, spec(target), num_gpu_blocks=24, max_model_len=64, preemption_mode=mode
    )
    assert token_ids(outs) == expected
    stats = assert_ran_clean(llm)
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_smaller_draft_with_n_above_one(models):
    target, draft, expected = models
    llm, outs = generate(target, spec(draft), n=2)
    assert token_ids(outs) == [[e[0], e[0]] for e in expected]
    assert_ran_clean(llm, accepted=True, rejected=True)


def test_draft_with_another_vocabulary_is_refused(models, tmp_path):
    target, _, _ = models
    other = save_tiny_checkpoint(tmp_path / "other", "llama", seed=1, vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(target), dtype="float32", device="cpu", speculative_config=spec(other))


def test_missing_draft_folder_is_refused(models, tmp_path):
    target, _, _ = models
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(target), dtype="float32", device="cpu", speculative_config=spec(tmp_path / "no"))


def test_self_draft_with_n_above_one_accepts_everything(models):
    # forked samples share the prompt's blocks, then copy on write: the draft's blocks too
    target, _, expected = models
    llm, outs = generate(target, spec(target), n=2)
    assert token_ids(outs) == [[e[0], e[0]] for e in expected]
    stats = assert_ran_clean(llm)
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_seeded_sampling_with_a_draft_repeats(models):
    # random requests verify the draft model's greedy drafts by rejection sampling (q a point
    # mass); a seeded request repeats exactly, and every block goes back
    target, draft, _ = models
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(
            str(target), dtype="float32", device="cpu", block_size=4, speculative_config=spec(draft)
        )
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
        runs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
        assert all(len(t[0]) == MAX_NEW for t in runs[-1])
        assert_ran_clean(llm)
    assert runs[0] == runs[1]


def test_a_failed_proposal_costs_only_that_steps_drafts(models, monkeypatch):
    target, draft, expected = models
    llm = LLM(
        str(target), dtype="float32", device="cpu", block_size=4, speculative_config=spec(draft)
    )
    proposer = llm.llm_engine.spec.draft
    calls = {"n": 0}
    propose = proposer.propose

    def failing_every_other(*args):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("injected draft failure")
        return propose(*args)

    monkeypatch.setattr(proposer, "propose", failing_every_other)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert token_ids(outs) == expected
    assert calls["n"] > 2
    assert_ran_clean(llm)
