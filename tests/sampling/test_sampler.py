"""Batched sampler: greedy, truncation, temperature, penalties, min_tokens, seeds, logprobs."""

import math

import pytest
import torch

from pagedllm.sampling import Sampler, SamplingMetadata
from pagedllm.sampling.ops import apply_penalties
from pagedllm.sampling_params import SamplingParams

DRAWS = 40_000
FREQ_TOL = 0.015  # ~6 standard deviations of a frequency estimated from DRAWS draws


def build(params, outputs=None, prompts=None, seq_index=None, *, vocab, eos=None):
    k = len(params)
    return SamplingMetadata.build(
        params,
        outputs if outputs is not None else [[] for _ in range(k)],
        prompts if prompts is not None else [[0] for _ in range(k)],
        seq_index if seq_index is not None else [0] * k,
        vocab_size=vocab,
        stop_token_ids=[p.all_stop_token_ids(eos) for p in params],
        device="cpu",
    )


def logits_from_probs(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


def draw_frequencies(logits_row, params, seed=0):
    """Sample DRAWS times from one logits row (as a batch of identical rows)."""
    logits = logits_row.expand(DRAWS, -1).contiguous()
    meta = build([params] * DRAWS, vocab=logits.shape[1])
    tokens = Sampler(torch.Generator().manual_seed(seed))(logits, meta).sampled_token_ids
    return torch.bincount(tokens, minlength=logits.shape[1]).float() / DRAWS


def assert_frequencies(freq, expected):
    expected = torch.tensor(expected, dtype=torch.float32)
    assert torch.all(freq[expected == 0] == 0), f"token outside the support drawn: {freq}"
    torch.testing.assert_close(freq, expected, atol=FREQ_TOL, rtol=0)


def test_greedy_picks_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, build([SamplingParams(temperature=0)] * 6, vocab=50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_greedy_rows_of_a_mixed_batch_pick_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.5),
    ]
    tokens = Sampler()(logits, build(params, vocab=30)).sampled_token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_plain_sampling_matches_softmax_frequencies():
    probs = [0.4, 0.3, 0.2, 0.1]
    assert_frequencies(draw_frequencies(logits_from_probs(probs), SamplingParams()), probs)


def test_top_k_restricts_support_to_k_most_likely():
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    freq = draw_frequencies(logits_from_probs(probs), SamplingParams(top_k=3))
    assert_frequencies(freq, [0, 0.40, 0, 0.25 / 0.75, 0.2 / 0.75, 0])


def test_top_p_keeps_smallest_set_reaching_p():
    probs = [0.05, 0.5, 0.1, 0.3, 0.05]
    freq = draw_frequencies(logits_from_probs(probs), SamplingParams(top_p=0.75))
    assert_frequencies(freq, [0, 0.625, 0, 0.375, 0])


def test_top_p_applies_after_top_k():
    probs = [0.4, 0.3, 0.2, 0.1]
    # top-k 2 leaves 4/7 and 3/7; top-p 0.5 then keeps the first only.
    freq = draw_frequencies(logits_from_probs(probs), SamplingParams(top_k=2, top_p=0.5))
    assert_frequencies(freq, [1.0, 0, 0, 0])


def test_min_p_drops_tokens_below_fraction_of_top_probability():
    probs = [0.1, 0.4, 0.05, 0.3, 0.15]
    freq = draw_frequencies(logits_from_probs(probs), SamplingParams(min_p=0.3))  # cut at 0.12
    assert_frequencies(freq, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85])


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_rescales_logits_before_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    freq = draw_frequencies(logits, SamplingParams(temperature=temperature))
    assert_frequencies(freq, (logits / temperature).softmax(-1).tolist())


def test_low_temperature_sharpens_and_high_flattens():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    top = [draw_frequencies(logits, SamplingParams(temperature=t))[0] for t in (0.3, 1.0, 3.0)]
    assert top[0] > top[1] > top[2]


def test_truncation_options_mixed_in_one_batch_apply_per_row():
    probs = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    params = [
        SamplingParams(top_k=1),
        SamplingParams(),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.6),
    ]
    logits = probs.repeat(len(params) * 2000, 1)
    meta = build(params * 2000, vocab=4)
    tokens = Sampler(torch.Generator().manual_seed(3))(logits, meta).sampled_token_ids.view(-1, 4)
    assert set(tokens[:, 0].tolist()) == {0}
    assert set(tokens[:, 1].tolist()) == {0, 1, 2, 3}
    assert set(tokens[:, 2].tolist()) == {0, 1}
    assert set(tokens[:, 3].tolist()) == {0, 1}


def test_penalties_match_hand_computed_reference():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, -0.5, 3.0]] * 2)
    penalized = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    meta = build(
        [SamplingParams(), penalized],
        outputs=[[1, 1, 2], [1, 1, 2]],
        prompts=[[0, 4], [0, 4]],
        vocab=6,
    )
    out = apply_penalties(logits, meta.penalties)
    # seen (prompt or output) = {0, 1, 2, 4}: positive / 2, negative * 2; then output counts
    # {1: 2, 2: 1} cost 0.5 each and 0.25 for being present.
    expected = torch.tensor([1.0, 0.5 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 0.5, -1.0, 3.0])
    torch.testing.assert_close(out[1], expected)
    torch.testing.assert_close(out[0], logits[0])


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    meta = build(
        [SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)],
        outputs=[[2]],
        prompts=[[0, 0, 1]],
        vocab=3,
    )
    torch.testing.assert_close(
        apply_penalties(logits, meta.penalties), torch.tensor([[1.0, 1.0, -1.0]])
    )


def test_repetition_penalty_turns_greedy_away_from_repeated_token():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    meta = build([SamplingParams(temperature=0, repetition_penalty=1.5)], outputs=[[0]], vocab=3)
    assert Sampler()(logits, meta).sampled_token_ids.item() == 1


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 5.0, 9.0, 8.0]])  # EOS 3 and stop id 4 dominate
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    early = build([params], outputs=[[0, 1]], vocab=5, eos=3)
    reached = build([params], outputs=[[0, 1, 2]], vocab=5, eos=3)
    assert Sampler()(logits, early).sampled_token_ids.item() == 2
    assert Sampler()(logits, reached).sampled_token_ids.item() == 3


def test_min_tokens_masks_every_eos_id_of_a_several_eos_checkpoint():
    logits = torch.tensor([[0.0, 9.0, 5.0, 8.0, 7.0]])  # EOS ids 1, 3 and 4 dominate
    params = SamplingParams(temperature=0, min_tokens=2)
    meta = build([params], outputs=[[0]], vocab=5, eos=(1, 3, 4))
    assert Sampler()(logits, meta).sampled_token_ids.item() == 2


def test_min_tokens_with_ignore_eos_leaves_eos_unmasked():
    logits = torch.tensor([[0.0, 9.0]])
    meta = build([SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)], vocab=2, eos=1)
    assert Sampler()(logits, meta).sampled_token_ids.item() == 1


SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=1234)


def run_steps(batch_params, seeded_row, steps=8, vocab=64):
    """Sample `steps` tokens for the seeded row inside a batch; other rows change every step."""
    engine_gen = torch.Generator().manual_seed(len(batch_params))
    sampler = Sampler(engine_gen)
    outputs = [[] for _ in batch_params]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(batch_params), vocab, generator=engine_gen)
        logits[seeded_row] = torch.randn(vocab, generator=torch.Generator().manual_seed(step))
        meta = build(batch_params, outputs=outputs, vocab=vocab)
        drawn = sampler(logits, meta).sampled_token_ids.tolist()
        for row, token in enumerate(drawn):
            outputs[row].append(token)
        tokens.append(drawn[seeded_row])
    return tokens


def test_seeded_row_gives_same_tokens_alone_and_in_a_batch():
    others = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.3),
        SamplingParams(seed=99, min_p=0.1),
        SamplingParams(temperature=1.7),
    ]
    alone = run_steps([SEEDED], 0)
    at_row_3 = run_steps(others[:3] + [SEEDED] + others[3:], 3)
    at_row_0 = run_steps([SEEDED] + others, 0)
    assert alone == at_row_3 == at_row_0
    assert len(set(alone)) > 1  # really sampling, not a constant


def test_forks_with_the_same_seed_draw_different_tokens():
    logits = torch.zeros(2, 1000)
    meta = build([SamplingParams(seed=5)] * 2, seq_index=[0, 1], vocab=1000)
    first, second = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert first != second


def test_unseeded_rows_follow_the_engine_generator():
    logits = torch.zeros(16, 100)
    meta = build([SamplingParams()] * 16, vocab=100)
    a = Sampler(torch.Generator().manual_seed(7))(logits, meta).sampled_token_ids
    b = Sampler(torch.Generator().manual_seed(7))(logits, meta).sampled_token_ids
    c = Sampler(torch.Generator().manual_seed(8))(logits, meta).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_logprobs_match_log_softmax_of_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.3),
        SamplingParams(logprobs=2, temperature=0),
        SamplingParams(top_k=3),
    ]
    out = Sampler()(logits, build(params, outputs=[[1, 2]] * 3, vocab=40))
    reference = torch.log_softmax(logits, dim=-1)
    tokens = out.sampled_token_ids
    lp = out.logprobs
    torch.testing.assert_close(lp.sampled_logprobs, reference.gather(1, tokens[:, None]).squeeze(1))
    expected_ranks = (reference > reference.gather(1, tokens[:, None])).sum(-1) + 1
    assert torch.equal(lp.sampled_ranks, expected_ranks)
    top = reference.topk(5, dim=-1)
    assert torch.equal(lp.top_token_ids, top.indices)
    torch.testing.assert_close(lp.top_logprobs, top.values)


def test_logprobs_entry_holds_sampled_token_and_top_n():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    meta = build(
        [SamplingParams(logprobs=2, temperature=0, presence_penalty=2.0)], outputs=[[0]], vocab=4
    )
    out = Sampler()(logits, meta)
    token = out.sampled_token_ids.item()
    entry = out.logprobs.tolists().entry(0, token, 2, decode=lambda t: f"<{t}>")
    assert token == 1
    assert list(entry) == [1, 0]
    assert entry[0].rank == 1 and entry[1].rank == 2
    assert math.isclose(entry[0].logprob, math.log(0.5), rel_tol=1e-5)
    assert entry[1].decoded_token == "<1>"


def test_logprobs_zero_returns_only_the_sampled_token():
    logits = torch.log(torch.tensor([[0.2, 0.8]]))
    out = Sampler()(logits, build([SamplingParams(logprobs=0, temperature=0)], vocab=2))
    entry = out.logprobs.tolists().entry(0, out.sampled_token_ids.item(), 0)
    assert list(entry) == [1] and entry[1].rank == 1


def test_no_logprobs_computed_when_none_asked():
    out = Sampler()(torch.randn(2, 8), build([SamplingParams()] * 2, vocab=8))
    assert out.logprobs is None


def test_all_greedy_batch_builds_no_sampling_tensors():
    meta = build([SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=3)] * 4, vocab=10)
    assert meta.all_greedy and not meta.seeds
    assert meta.temperature is meta.top_k is meta.top_p is meta.min_p is meta.penalties is None


def test_penalty_tensors_cover_only_rows_using_penalties():
    meta = build(
        [SamplingParams(), SamplingParams(frequency_penalty=0.5), SamplingParams()],
        outputs=[[1], [2, 2], [3]],
        vocab=5,
    )
    assert meta.penalties.rows.tolist() == [1]
    assert meta.penalties.output_counts.tolist() == [[0, 0, 2, 0, 0]]
    assert meta.penalties.seen is None  # no repetition penalty: prompt tokens never read


def test_sampler_does_not_modify_the_callers_logits():
    logits = torch.randn(2, 6)
    before = logits.clone()
    meta = build(
        [SamplingParams(temperature=0.5, repetition_penalty=2.0, min_tokens=1)] * 2,
        outputs=[[1], []],
        vocab=6,
        eos=0,
    )
    Sampler()(logits, meta)
    assert torch.equal(logits, before)


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.randn(3, 5), build([SamplingParams()] * 2, vocab=5))
