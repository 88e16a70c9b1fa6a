"""Verification: greedy keeps exactly the target's argmax tokens; rejection sampling emits tokens
distributed as the target's distribution (chi-square over many seeded trials, at a level that
cannot flake: p < 1e-6), for point-mass (n-gram) and full draft distributions alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sampling import SamplingMetadata
from pagedllm.sampling.verification import verification_rows
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode import RejectionSampler

VOCAB = 6
# a chi-square p-value below this fails: a correct sampler fails once in a million runs
ALPHA = 1e-6


def rows_meta(params: list[SamplingParams], drafts: list[list[int]]) -> SamplingMetadata:
    n = len(params)
    return verification_rows(
        params,
        [[] for _ in range(n)],
        [[0] for _ in range(n)],
        [0] * n,
        drafts,
        vocab_size=VOCAB,
        stop_token_ids=[()] * n,
        device="cpu",
    )


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_greedy_accepts_while_the_argmax_agrees_then_emits_the_argmax():
    # target argmax per position: 3, 1, 4 | 2, 5
    logits = torch.full((5, VOCAB), -5.0)
    for row, token in enumerate([3, 1, 4, 2, 5]):
        logits[row, token] = 5.0
    drafts = [[3, 0], [2]]  # first: 3 accepted, 0 rejected (-> 1); second: all accepted + bonus 5
    meta = rows_meta([SamplingParams(temperature=0.0)] * 2, drafts)
    out = RejectionSampler()(
        logits, meta, np.array([2, 1]), torch.tensor([3, 0, 2]), draft_probs=None
    )
    assert out.num_tokens.tolist() == [2, 2]
    assert out.num_accepted.tolist() == [1, 1]
    assert out.token_ids.tolist() == [3, 1, 2, 5]


def test_a_sample_without_drafts_is_sampled_plainly():
    logits = torch.tensor([[0.0, 9.0, 0.0, 0.0, 0.0, 0.0]])
    meta = rows_meta([SamplingParams(temperature=0.0)], [[]])
    out = RejectionSampler()(logits, meta, np.array([0]), torch.tensor([], dtype=torch.int64))
    assert out.token_ids.tolist() == [1] and out.num_tokens.tolist() == [1]


def target_logits(trials: int, positions: int) -> torch.Tensor:
    base = torch.tensor(
        [[0.3, 1.2, -0.5, 0.8, 0.0, -1.0], [1.0, -0.2, 0.4, 0.1, 0.9, -0.6]][:positions]
    )
    return base.repeat(trials, 1)


def emitted(out, position: int) -> np.ndarray:
    """Token at `position` of each sample that emitted that many."""
    tokens = out.token_ids.numpy()
    starts = np.cumsum(out.num_tokens) - out.num_tokens
    has = out.num_tokens > position
    return tokens[starts[has] + position]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_point_mass_drafts_keep_the_target_distribution(temperature):
    trials = 60_000
    # draft token 1 then 4: the first is often accepted (likely under p), then 4 is judged
    logits = target_logits(trials, 2)
    drafts = [[1]] * trials
    meta = rows_meta([SamplingParams(temperature=temperature)] * trials, drafts)
    sampler = RejectionSampler(torch.Generator().manual_seed(1))
    out = sampler(logits, meta, np.ones(trials, dtype=np.int64), torch.ones(trials).long())
    p = (logits[:2] / temperature).softmax(-1).numpy()
    first = emitted(out, 0)
    assert chi_square_p_value(np.bincount(first, minlength=VOCAB), p[0]) > ALPHA
    # after an accepted draft, the bonus token follows p at the next position
    second = emitted(out, 1)
    assert len(second) == (first == 1).sum()
    assert chi_square_p_value(np.bincount(second, minlength=VOCAB), p[1]) > ALPHA
    # acceptance happens at rate p(draft)
    rate = (out.num_accepted == 1).mean()
    assert abs(rate - p[0][1]) < 6 * np.sqrt(p[0][1] * (1 - p[0][1]) / trials)


def test_draft_model_distributions_keep_the_target_distribution():
    trials = 60_000
    logits = target_logits(trials, 2)
    q = torch.tensor([0.05, 0.1, 0.5, 0.05, 0.2, 0.1])
    gen = torch.Generator().manual_seed(2)
    draft_tokens = torch.multinomial(q, trials, replacement=True, generator=gen)
    meta = rows_meta([SamplingParams(temperature=1.0)] * trials, [[0]] * trials)
    out = RejectionSampler(torch.Generator().manual_seed(3))(
        logits, meta, np.ones(trials, dtype=np.int64), draft_tokens, q.repeat(trials, 1)
    )
    p = logits[:2].softmax(-1).numpy()
    first = emitted(out, 0)
    assert chi_square_p_value(np.bincount(first, minlength=VOCAB), p[0]) > ALPHA
    second = emitted(out, 1)
    assert chi_square_p_value(np.bincount(second, minlength=VOCAB), p[1]) > ALPHA


def test_top_k_is_respected_by_the_resample():
    trials = 20_000
    logits = target_logits(trials, 2)
    meta = rows_meta([SamplingParams(temperature=1.0, top_k=2)] * trials, [[0]] * trials)
    out = RejectionSampler(torch.Generator().manual_seed(4))(
        logits, meta, np.ones(trials, dtype=np.int64), torch.zeros(trials, dtype=torch.int64)
    )
    top2 = set(logits[0].topk(2).indices.tolist())
    # draft 0 is outside the top 2 of position 0: never accepted, replaced within the top 2
    assert out.num_accepted.max() == 0
    assert set(emitted(out, 0).tolist()) <= top2


def test_seeded_requests_repeat_whatever_the_batch():
    logits = target_logits(1, 2)
    params = SamplingParams(temperature=1.0, seed=1234)
    runs = []
    for others in (0, 3):
        batch = [SamplingParams(temperature=1.0)] * others + [params]
        meta = rows_meta(batch, [[1]] * (others + 1))
        out = RejectionSampler(torch.Generator().manual_seed(others))(
            logits.repeat(others + 1, 1),
            meta,
            np.ones(others + 1, dtype=np.int64),
            torch.ones(others + 1).long(),
        )
        n = int(out.num_tokens[-1])
        runs.append(out.token_ids[-n:].tolist())
    assert runs[0] == runs[1]


def test_row_count_mismatch_is_refused():
    meta = rows_meta([SamplingParams(temperature=0.0)], [[1, 2]])
    with pytest.raises(ValueError, match="3 rows"):
        RejectionSampler()(torch.zeros(2, VOCAB), meta, np.array([2]), torch.tensor([1, 2]))
