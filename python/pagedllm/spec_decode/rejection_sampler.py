"""Verification of draft tokens against the target model, for a whole step at once.

A sample with `d` draft tokens is scored at `d + 1` positions in one forward: position `j` gives
the target's distribution of the token after the sequence extended by drafts `0..j-1`. Those
`R = sum(d + 1)` rows arrive as one logits tensor, with a `SamplingMetadata` of `R` rows whose
row for position `j` sees the drafts before it as output (penalties, min_tokens, seeds: see
`sampling.verification.verification_rows`).

- Greedy rows: accept while the draft equals the target's argmax; the first mismatch is
  replaced by the argmax, and a fully accepted run gets the argmax of its last position (the
  bonus token). The tokens are exactly those of greedy decoding without speculation.
- Random rows: rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft `x` with
  draft probability `q(x)` is accepted with probability `min(1, p(x) / q(x))`; on rejection the
  token is drawn from the residual `max(p - q, 0)`, normalized; a fully accepted run draws its
  bonus token from `p` at the last position. Every emitted token is then distributed exactly as
  the target's `p`. For a proposer without probabilities (n-gram) `q` is a point mass on the
  draft, so acceptance is `p(x)` and the residual is `p` without `x`.

`p` is the distribution the non-speculative sampler draws from (`sampler.random_probs`, after
the min_tokens mask and penalties), so temperature, top-k, top-p and min-p carry over. A seeded
row draws its uniform and then its noise from a generator seeded per position
(`seeds.sample_seed` of the token index it decides), so a seeded request repeats exactly given
the same drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.sampler import mask_logits, random_probs

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class VerifiedTokens:
    """What verification emits: sample `i` gets `num_tokens[i]` tokens (its accepted drafts plus
    one), consecutive in `token_ids`."""

    token_ids: torch.Tensor  # int64 [sum(num_tokens)], on the logits' device
    num_tokens: np.ndarray  # int64 [N], 1 .. d_i + 1
    num_accepted: np.ndarray  # int64 [N], accepted drafts (num_tokens - 1)
    logprobs: LogprobsTensors | None  # per emitted token; None when no row asked


class RejectionSampler:
    """Verifies draft tokens (see the module doc). `generator` drives unseeded rows (the engine's
    sampling generator); seeded rows use their own per-position seed."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._seeded: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        num_draft_tokens: np.ndarray,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
    ) -> VerifiedTokens:
        """`logits` [R, V] and `meta` (R rows) are sample `i`'s `d_i + 1` positions in order;
        `num_draft_tokens` [N] the `d_i` (0 allowed: plain sampling), `draft_token_ids` [D] the
        drafts in the same order, `draft_probs` [D, V] the proposer's distributions (None: a
        point mass on each draft)."""
        d = np.asarray(num_draft_tokens, dtype=np.int64)
        num_rows = int(d.sum()) + len(d)
        if logits.shape[0] != num_rows or meta.num_rows != num_rows:
            raise ValueError(
                f"verification needs {num_rows} rows (drafts + one per sample), got logits "
                f"{logits.shape[0]}, metadata {meta.num_rows}"
            )
        if draft_token_ids.shape[0] != int(d.sum()):
            raise ValueError(f"{draft_token_ids.shape[0]} draft tokens for {int(d.sum())} drafts")
        device = logits.device
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = mask_logits(logits, meta)
        starts = np.cumsum(d + 1) - (d + 1)
        is_draft = np.ones(num_rows, dtype=bool)
        is_draft[starts + d] = False
        draft_rows = torch.from_numpy(np.flatnonzero(is_draft)).to(device)
        # the draft each row judges (0 on bonus rows, never read there)
        draft_at = torch.zeros(num_rows, dtype=torch.int64, device=device)
        draft_at[draft_rows] = draft_token_ids.to(device=device, dtype=torch.int64)
        accepted, candidate = self._judge(logits, meta, draft_at, draft_rows, draft_probs)
        accepted[~torch.from_numpy(is_draft).to(device)] = False
        # first rejected position of each sample (its bonus row when every draft is accepted)
        rejected = np.flatnonzero(~accepted.cpu().numpy())
        first = rejected[np.searchsorted(rejected, starts)]
        num_accepted = first - starts
        sample_of_row = np.repeat(np.arange(len(d)), d + 1)
        keep = np.arange(num_rows) - starts[sample_of_row] <= num_accepted[sample_of_row]
        keep_rows = torch.from_numpy(np.flatnonzero(keep)).to(device)
        tokens = torch.where(accepted, draft_at, candidate).index_select(0, keep_rows)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs(
                raw_logprobs.index_select(0, keep_rows), tokens, meta.max_num_logprobs
            )
        return VerifiedTokens(tokens, num_accepted + 1, num_accepted, logprobs)

    def _judge(self, logits, meta, draft_at, draft_rows, draft_probs):
        """Per row: whether its draft is accepted, and the token emitted if the run stops there
        (the target's replacement for a rejected draft, or the bonus token)."""
        greedy_tokens = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_tokens == draft_at, greedy_tokens
        probs = random_probs(logits, meta)
        uniform, noise = self._randomness(probs.shape, meta, probs.device)
        rows = torch.arange(probs.shape[0], device=probs.device)
        p_draft = probs[rows, draft_at]
        residual = probs.clone()
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            residual[rows, draft_at] = 0.0
        else:
            q = torch.zeros_like(probs)
            q[draft_rows] = draft_probs.to(device=probs.device, dtype=torch.float32)
            q_draft = q[rows, draft_at]
            residual = (probs - q).clamp_min_(0.0)
        # a draft the proposer could not have drawn (q = 0) is never accepted
        accepted = (q_draft > 0) & (uniform * q_draft < p_draft)
        # bonus rows draw from p; a residual with no mass (p <= q everywhere) only occurs when
        # acceptance is certain, so p serves there too
        bonus = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
        bonus[draft_rows] = False
        empty = residual.sum(dim=-1) <= 0
        weights = torch.where((bonus | empty).unsqueeze(1), probs, residual)
        # exponential race: argmax(w / E) with E ~ Exp(1) draws from w / sum(w)
        drawn = weights.div_(noise).argmax(dim=-1)
        if meta.all_random:
            return accepted, drawn
        return (
            torch.where(meta.greedy, greedy_tokens == draft_at, accepted),
            torch.where(meta.greedy, greedy_tokens, drawn),
        )

    def _randomness(self, shape, meta: SamplingMetadata, device):
        """A uniform [R] and Exp(1) noise [R, V]: one batched draw each, then every seeded row
        redrawn from its own seed (uniform first, then its noise)."""
        uniform = torch.rand(shape[0], device=device, generator=self.generator)
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        noise.exponential_(generator=self.generator)
        if meta.seeds:
            seeded = self._seeded.setdefault(device, torch.Generator(device=device))
            for row, seed in meta.seeds:
                seeded.manual_seed(seed)
                uniform[row] = torch.rand(1, device=device, generator=seeded)[0]
                noise[row].exponential_(generator=seeded)
        return uniform, noise.clamp_min_(_TINY)
