"""Batched sampling on the logits' device.

One step: the engine gathers the logits rows the scheduler asked for (`logits[sample_rows]`,
shape [K, V]; rows are already repeated for n > 1 forks), builds a `SamplingMetadata` from each
sample's `SamplingParams` and state, and calls a `Sampler`. Everything below works on whole
[K, V] tensors; Python only loops over the K rows to gather parameters, never over the vocabulary.
Features no row uses cost nothing: an all-greedy batch without penalties is one argmax.

Processing order (vLLM V1): min_tokens mask -> penalties -> greedy argmax | (temperature ->
min-p -> top-k -> top-p -> softmax -> exponential race).

Logprobs are those of the *raw* model distribution, `log_softmax(logits)` before min_tokens,
penalties, temperature or truncation (vLLM V1's default "raw_logprobs"): they score what the
model believes, independent of how the caller chose to sample, and `rank` 1 is the model's top
token. `cumulative_logprob` sums these.

Seeds: a seeded sample draws its noise from a generator seeded with a hash of
(seed, index of the sequence in its request, number of tokens generated so far). That makes its
tokens independent of the rest of the batch and of its row, needs no per-sequence state in the
engine, and repeats exactly after a preemption that recomputes the sequence. Unseeded samples
share one batched draw from the engine's generator.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .outputs import Logprob
from .sampling_params import SamplingParams

_MASK_64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def sample_seed(seed: int, seq_index: int, num_generated: int) -> int:
    """Seed of the noise for one token of one seeded sequence (63 bits: torch's range)."""
    h = _splitmix64(seed & _MASK_64)
    h = _splitmix64(h ^ (seq_index & _MASK_64))
    return _splitmix64(h ^ (num_generated & _MASK_64)) >> 1


@dataclass
class PenaltyBatch:
    """Penalty inputs of the rows that use penalties (`rows` None: every row does)."""

    rows: torch.Tensor | None          # int64 [R]
    presence: torch.Tensor             # float32 [R, 1]
    frequency: torch.Tensor            # float32 [R, 1]
    repetition: torch.Tensor | None    # float32 [R, 1]; None when no row uses it
    output_counts: torch.Tensor        # float32 [R, V] occurrences in the output so far
    seen: torch.Tensor | None          # bool [R, V] in prompt or output (repetition only)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for K samples, built once per step by `build`.

    Every optional tensor is None when no row uses the feature, so the sampler skips it.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor | None        # bool [K], only for a mixed batch
    temperature: torch.Tensor | None   # float32 [K, 1]; 1.0 on greedy rows
    top_k: torch.Tensor | None         # int64 [K]; 0 = off
    max_top_k: int
    top_p: torch.Tensor | None         # float32 [K]; 1.0 = off
    min_p: torch.Tensor | None         # float32 [K]; 0.0 = off
    penalties: PenaltyBatch | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked by min_tokens
    seeds: list[tuple[int, int]]       # (row, generator seed) of seeded random rows
    max_num_logprobs: int | None       # largest `logprobs` asked; None: no row asked

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        seq_index: Sequence[int],
        *,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Gather row parameters. Row i samples for a sequence with `params[i]`, tokens generated
        so far `output_token_ids[i]` (before this step), prompt `prompt_token_ids[i]` and index
        `seq_index[i]` in its request. The token lists are only read for rows using penalties."""
        greedy = [p.is_greedy for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        top_k, max_top_k = _top_k(params, greedy, vocab_size, device)
        return cls(
            num_rows=len(params),
            all_greedy=not random_rows,
            all_random=len(random_rows) == len(params),
            greedy=_greedy_mask(greedy, device),
            temperature=_temperature(params, greedy, device),
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=_row_values(params, greedy, "top_p", 1.0, device),
            min_p=_row_values(params, greedy, "min_p", 0.0, device),
            penalties=_penalties(params, output_token_ids, prompt_token_ids, vocab_size, device),
            banned=_min_tokens_ban(params, output_token_ids, eos_token_id, vocab_size, device),
            seeds=[(i, sample_seed(params[i].seed, seq_index[i], len(output_token_ids[i])))
                   for i in random_rows if params[i].seed is not None],
            max_num_logprobs=max(asked) if asked else None,
        )


def _greedy_mask(greedy: list[bool], device) -> torch.Tensor | None:
    if all(greedy) or not any(greedy):
        return None
    return torch.tensor(greedy, dtype=torch.bool, device=device)


def _temperature(params, greedy, device) -> torch.Tensor | None:
    values = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
    if all(v == 1.0 for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _top_k(params, greedy, vocab_size, device) -> tuple[torch.Tensor | None, int]:
    # k >= V keeps everything, so it is "off" too.
    values = [0 if g or not p.uses_top_k or p.top_k >= vocab_size else p.top_k
              for p, g in zip(params, greedy)]
    if not any(values):
        return None, 0
    return torch.tensor(values, dtype=torch.int64, device=device), max(values)


def _row_values(params, greedy, name: str, off: float, device) -> torch.Tensor | None:
    values = [off if g else float(getattr(p, name)) for p, g in zip(params, greedy)]
    if all(v == off for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device)


def _padded(rows: list[Sequence[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    data = [list(r) + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(data, dtype=torch.int64, device=device).reshape(len(rows), width)


def _token_counts(rows: list[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """float32 [R, V]: occurrences of each token per row (padding lands in a dropped column)."""
    ids = _padded(rows, vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _penalties(params, output_token_ids, prompt_token_ids, vocab_size, device) -> PenaltyBatch | None:
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    if not rows:
        return None
    chosen = [params[i] for i in rows]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(p, name)) for p in chosen], device=device).unsqueeze(1)

    counts = _token_counts([output_token_ids[i] for i in rows], vocab_size, device)
    repetition = seen = None
    if any(p.repetition_penalty != 1.0 for p in chosen):
        repetition = column("repetition_penalty")
        seen = (_token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0) | (counts > 0)
    row_index = None if len(rows) == len(params) else torch.tensor(rows, dtype=torch.int64, device=device)
    return PenaltyBatch(row_index, column("presence_penalty"), column("frequency_penalty"),
                        repetition, counts, seen)


def _min_tokens_ban(params, output_token_ids, eos_token_id, vocab_size, device):
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) < p.min_tokens:
            for t in p.all_stop_token_ids(eos_token_id):
                if t < vocab_size:  # an id the model cannot produce needs no mask
                    rows.append(i)
                    tokens.append(t)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(tokens, dtype=torch.int64, device=device))


# --- logits processing ---------------------------------------------------------------------------

def apply_penalties(logits: torch.Tensor, pen: PenaltyBatch) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens (divide positive logits, multiply
    the others), then frequency * count and presence * [count > 0] over output tokens."""
    sub = logits if pen.rows is None else logits.index_select(0, pen.rows)
    if pen.repetition is not None:
        factor = torch.where(pen.seen, pen.repetition, torch.ones_like(pen.repetition))
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    sub = sub - pen.frequency * pen.output_counts - pen.presence * (pen.output_counts > 0)
    return sub if pen.rows is None else logits.index_copy(0, pen.rows, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, in logit space: logit < max + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept); k = 0 keeps all."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    kth = kth.masked_fill((top_k == 0).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then nucleus filtering with one ascending sort. A token survives top-p when the
    tokens more likely than it hold less than top_p of the mass; the top token always does."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)
        position = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(position < (vocab - k).unsqueeze(1), float("-inf"))
    mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = mass_up_to <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(shape, meta: SamplingMetadata, device, generator, seeded) -> torch.Tensor:
    """Exp(1) noise: one batched draw, then each seeded row redrawn from its own seed."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    for row, seed in meta.seeds:
        seeded.manual_seed(seed)
        noise[row].exponential_(generator=seeded)
    # exponential_ may return exactly 0 on some backends; 0 would make the ratio below inf/nan.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _sample_random(logits, meta: SamplingMetadata, generator, seeded) -> torch.Tensor:
    if meta.temperature is not None:
        logits = logits / meta.temperature
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
    probs = logits.softmax(dim=-1)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p.
    noise = _exponential_noise(probs.shape, meta, logits.device, generator, seeded)
    return probs.div_(noise).argmax(dim=-1)


# --- logprobs ------------------------------------------------------------------------------------

@dataclass
class LogprobsTensors:
    """Raw-distribution logprobs of a step, on the logits' device."""

    sampled_logprobs: torch.Tensor   # float32 [K]
    sampled_ranks: torch.Tensor      # int64 [K], 1 = most likely token
    top_token_ids: torch.Tensor      # int64 [K, N], N = largest `logprobs` asked
    top_logprobs: torch.Tensor       # float32 [K, N]

    def tolists(self) -> LogprobsLists:
        """Copy to host once per step (one sync), for building `Logprob` dicts."""
        return LogprobsLists(self.sampled_logprobs.tolist(), self.sampled_ranks.tolist(),
                             self.top_token_ids.tolist(), self.top_logprobs.tolist())


@dataclass
class LogprobsLists:
    sampled_logprobs: list[float]
    sampled_ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def entry(self, row: int, token_id: int, num_logprobs: int,
              decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
        """vLLM's per-token logprobs dict: the sampled token plus the `num_logprobs` most likely
        (so num_logprobs or num_logprobs + 1 entries)."""
        def make(lp: float, rank: int, tid: int) -> Logprob:
            return Logprob(lp, rank, decode(tid) if decode is not None else None)

        out = {token_id: make(self.sampled_logprobs[row], self.sampled_ranks[row], token_id)}
        ids, lps = self.top_token_ids[row], self.top_logprobs[row]
        for rank, (tid, lp) in enumerate(zip(ids[:num_logprobs], lps[:num_logprobs]), start=1):
            out.setdefault(tid, make(lp, rank, tid))
        return out


def compute_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int) -> LogprobsTensors:
    sampled = raw_logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    top = raw_logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(sampled.squeeze(1), ranks, top.indices, top.values)


# --- the sampler ---------------------------------------------------------------------------------

@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # int64 [K], on the logits' device
    logprobs: LogprobsTensors | None         # None when no row asked for logprobs


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

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows, metadata {meta.num_rows}")
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        if meta.banned is not None:
            logits = logits.index_put(meta.banned, torch.tensor(float("-inf"), device=logits.device))
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        tokens = self._choose(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs(raw_logprobs, tokens, meta.max_num_logprobs)
        return SamplerOutput(tokens, logprobs)

    def _choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        drawn = _sample_random(logits, meta, self.generator, self._seeded_generator(logits.device))
        if meta.all_random:
            return drawn
        return torch.where(meta.greedy, logits.argmax(dim=-1), drawn)
