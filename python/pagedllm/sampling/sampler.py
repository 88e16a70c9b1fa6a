"""Batched sampling on the logits' device.

One step: the engine gathers the logits rows the scheduler asked for (`logits[sample_rows]`,
shape [K, V]; rows are already repeated for n > 1 forks), builds a `SamplingMetadata` from each
sample's `SamplingParams` and state, and calls a `Sampler`. Everything below works on whole
[K, V] tensors; Python only loops over the K rows to gather parameters, never over the vocabulary.
Features no row uses cost nothing: an all-greedy batch without penalties is one argmax.

Processing order (vLLM V1): structured output's token bitmask -> allowed_token_ids -> bad_words
-> min_tokens mask -> logit_bias -> penalties ->
greedy argmax | (temperature -> min-p -> top-k -> top-p -> softmax -> exponential race). The
bitmask comes first, as in vLLM where it is applied to the logits before the sampler runs, so
everything after it (logprobs included) sees only the tokens the grammar allows.

Logprobs are those of the *raw* model distribution (after the grammar mask, if any),
`log_softmax(logits)` before allowed_token_ids, bad_words, min_tokens, logit_bias, penalties,
temperature or truncation (vLLM V1's default "raw_logprobs"): they score what the model
believes, independent of how the caller chose to sample, and `rank` 1 is the model's top token.
`cumulative_logprob` sums these.

Seeds: a seeded sample redraws its noise from its own generator (`pagedllm.sampling.seeds`);
unseeded samples share one batched draw from the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sampling.grammar_mask import TokenBitmask, apply_token_bitmask
from pagedllm.sampling.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.ops import (
    apply_allowed,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    argmax_rows,
)


def _exponential_noise(shape, meta: SamplingMetadata, device, generator, seeded) -> torch.Tensor:
    """Exp(1) noise: one batched draw, then each seeded row redrawn from its own seed."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    for row, seed in meta.seeds:
        seeded.manual_seed(seed)
        noise[row].exponential_(generator=seeded)
    # exponential_ may return exactly 0 on some backends; 0 would make the ratio below inf/nan.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def random_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: temperature -> min-p -> top-k -> top-p ->
    softmax over `logits` already through the min_tokens mask and penalties (`mask_logits`).
    Speculative verification accepts against exactly this distribution."""
    if meta.temperature is not None:
        logits = logits / meta.temperature
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
    return logits.softmax(dim=-1)


def mask_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The first processing stages, shared by greedy and random rows, in vLLM's order:
    allowed_token_ids, bad_words, the min_tokens mask, logit_bias, then penalties."""
    if meta.allowed is not None:
        logits = apply_allowed(logits, *meta.allowed)
    if meta.bad_words is not None:
        logits = logits.index_put(meta.bad_words, _minus_inf(logits))
    if meta.banned is not None:
        logits = logits.index_put(meta.banned, _minus_inf(logits))
    if meta.logit_bias is not None:
        rows, tokens, biases = meta.logit_bias
        logits = logits.index_put((rows, tokens), biases, accumulate=True)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def _minus_inf(logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float("-inf"), device=logits.device)


def _sample_random(logits, meta: SamplingMetadata, generator, seeded) -> torch.Tensor:
    probs = random_probs(logits, meta)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p.
    noise = _exponential_noise(probs.shape, meta, logits.device, generator, seeded)
    return argmax_rows(probs.div_(noise))


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [K], on the logits' device
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Draws one token per row of `logits`. `generator` (on the logits' device, seeded from the
    engine's seed) drives the unseeded rows; None uses torch's default generator."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._seeded: dict[torch.device, torch.Generator] = {}

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        # One generator per device, re-seeded per seeded row: creating one per row is wasteful.
        if device not in self._seeded:
            self._seeded[device] = torch.Generator(device=device)
        return self._seeded[device]

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        grammar_mask: TokenBitmask | None = None,
    ) -> SamplerOutput:
        """`grammar_mask`: structured output's allowed tokens for the constrained rows."""
        if logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, metadata {meta.num_rows}")
        logits = logits.float()
        if grammar_mask is not None:
            logits = apply_token_bitmask(logits, grammar_mask)
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = mask_logits(logits, meta)
        tokens = self._choose(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs(raw_logprobs, tokens, meta.max_num_logprobs)
        return SamplerOutput(tokens, logprobs)

    def _choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return argmax_rows(logits)
        drawn = _sample_random(logits, meta, self.generator, self._seeded_generator(logits.device))
        if meta.all_random:
            return drawn
        return torch.where(meta.greedy, argmax_rows(logits), drawn)
