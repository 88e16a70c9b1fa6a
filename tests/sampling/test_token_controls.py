"""logit_bias, allowed_token_ids and bad_words in the batched sampler, on crafted logits."""

import dataclasses

import pytest
import torch

from pagedllm.sampling import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

VOCAB = 8
GREEDY = dict(temperature=0.0)


def build(params, outputs=None):
    k = len(params)
    return SamplingMetadata.build(
        params,
        outputs if outputs is not None else [[] for _ in range(k)],
        [[0] for _ in range(k)],
        [0] * k,
        vocab_size=VOCAB,
        stop_token_ids=[[] for _ in range(k)],
        device="cpu",
    )


def ramp(rows: int = 1) -> torch.Tensor:
    """Logits whose argmax is the last token, then the one before, and so on."""
    return torch.arange(VOCAB, dtype=torch.float32).expand(rows, -1).contiguous()


def greedy(params, logits=None, outputs=None):
    logits = ramp(len(params)) if logits is None else logits
    return Sampler()(logits, build(params, outputs)).sampled_token_ids.tolist()


def with_bad_words(words: list[list[int]], **kwargs) -> SamplingParams:
    return dataclasses.replace(SamplingParams(**kwargs), _bad_words_token_ids=words)


def test_a_batch_without_token_controls_builds_none_of_them():
    meta = build([SamplingParams(**GREEDY), SamplingParams()])
    assert (meta.allowed, meta.bad_words, meta.logit_bias) == (None, None, None)


def test_logit_bias_moves_the_greedy_choice():
    params = [SamplingParams(**GREEDY, logit_bias={2: 100.0}), SamplingParams(**GREEDY)]
    assert greedy(params) == [2, VOCAB - 1]


def test_negative_logit_bias_bans_the_top_token():
    assert greedy([SamplingParams(**GREEDY, logit_bias={VOCAB - 1: -100.0})]) == [VOCAB - 2]


def test_logit_bias_adds_to_the_logit():
    # token 5 (logit 5) + 2.5 beats token 7 (logit 7); + 1.5 does not
    assert greedy([SamplingParams(**GREEDY, logit_bias={5: 2.5})]) == [5]
    assert greedy([SamplingParams(**GREEDY, logit_bias={5: 1.5})]) == [VOCAB - 1]


def test_allowed_token_ids_limit_greedy_choice_to_them():
    params = [SamplingParams(**GREEDY, allowed_token_ids=[1, 3]), SamplingParams(**GREEDY)]
    assert greedy(params) == [3, VOCAB - 1]


def test_allowed_token_ids_limit_random_draws_to_them():
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[0, 4])] * 500
    drawn = Sampler(torch.Generator().manual_seed(0))(ramp(500), build(params))
    assert set(drawn.sampled_token_ids.tolist()) == {0, 4}


def test_one_token_bad_word_is_always_banned():
    assert greedy([with_bad_words([[VOCAB - 1]], **GREEDY)]) == [VOCAB - 2]


def test_bad_word_last_token_is_banned_only_after_its_prefix():
    word = [[3, VOCAB - 1]]
    params = [with_bad_words(word, **GREEDY)] * 3
    outputs = [[5, 3], [3, 5], []]
    assert greedy(params, outputs=outputs) == [VOCAB - 2, VOCAB - 1, VOCAB - 1]


def test_token_controls_leave_logprobs_raw():
    params = [SamplingParams(**GREEDY, logprobs=1, logit_bias={0: 100.0})]
    out = Sampler()(ramp(), build(params))
    raw = ramp().log_softmax(dim=-1)
    assert out.sampled_token_ids.tolist() == [0]
    assert out.logprobs.sampled_logprobs.tolist() == pytest.approx([raw[0, 0].item()])
    assert out.logprobs.sampled_ranks.tolist() == [VOCAB]


def test_logit_bias_cannot_bring_back_a_token_allowed_token_ids_mask():
    # allowed masks token 6 to -inf: a bias cannot bring it back
    params = [SamplingParams(**GREEDY, allowed_token_ids=[1, 2], logit_bias={6: 100.0})]
    assert greedy(params) == [2]
