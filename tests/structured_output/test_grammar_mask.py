"""The token bitmask in the sampler: disallowed tokens of the constrained rows get -inf before
any other sampling step; other rows are untouched."""

from __future__ import annotations

import torch

from pagedllm.sampling import Sampler, SamplingMetadata
from pagedllm.sampling.grammar_mask import TokenBitmask, allowed_tokens, apply_token_bitmask
from pagedllm.sampling_params import SamplingParams


def bits_allowing(tokens: list[int], words: int) -> torch.Tensor:
    row = torch.zeros(words, dtype=torch.int64)
    for t in tokens:
        row[t // 32] |= 1 << (t % 32)
    # int32 words with the top bit set are negative, as llguidance writes them
    return row.to(torch.int32).unsqueeze(0)


def test_allowed_tokens_unpacks_llguidance_words_and_pads_past_the_mask():
    bits = bits_allowing([0, 31, 33], 2)
    allowed = allowed_tokens(bits, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 33]


def test_masked_rows_keep_only_allowed_tokens_and_free_rows_are_untouched():
    logits = torch.randn(3, 40)
    mask = TokenBitmask(torch.tensor([1]), bits_allowing([5, 7], 2))
    out = apply_token_bitmask(logits, mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [5, 7]
    assert not torch.equal(out, logits), "the caller's logits are left as they were"


def test_sampler_applies_the_mask_before_temperature_and_top_k():
    logits = torch.zeros(2, 64)
    logits[:, 3] = 10.0  # the model's favourite, disallowed in row 0
    logits[:, 40] = 1.0
    params = [SamplingParams(temperature=0.8, top_k=1, seed=1)] * 2
    meta = SamplingMetadata.build(
        params, [[], []], [[1], [1]], [0, 0], vocab_size=64, stop_token_ids=[(), ()], device="cpu"
    )
    mask = TokenBitmask(torch.tensor([0]), bits_allowing([40, 41], 2))
    tokens = Sampler()(logits, meta, mask).sampled_token_ids.tolist()
    assert tokens == [40, 3]


def test_subset_follows_the_rows_it_keeps():
    mask = TokenBitmask(torch.tensor([0, 2]), torch.tensor([[1], [2]], dtype=torch.int32))
    sub = mask.subset([2, 1])
    assert sub.rows.tolist() == [0] and sub.bits.tolist() == [[2]]
    assert mask.subset([1]) is None


def test_a_fully_constrained_batch_is_masked_in_one_pass():
    logits = torch.randn(2, 40)
    mask = TokenBitmask(torch.tensor([0, 1]), torch.cat([bits_allowing([1], 2)] * 2))
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out).nonzero()[:, 1].tolist() == [1, 1]
