"""`SamplingMetadata`: one step's sampling inputs as [K]-row tensors, built from each sample's
`SamplingParams` and state. Python loops over the K rows here, never over the vocabulary; a
feature no row uses stays None and costs the sampler nothing."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedllm.sampling.seeds import sample_seed
from pagedllm.sampling_params import SamplingParams


@dataclass
class PenaltyBatch:
    """Penalty inputs of the rows that use penalties (`rows` None: every row does)."""

    rows: torch.Tensor | None  # int64 [R]
    presence: torch.Tensor  # float32 [R, 1]
    frequency: torch.Tensor  # float32 [R, 1]
    repetition: torch.Tensor | None  # float32 [R, 1]; None when no row uses it
    output_counts: torch.Tensor  # float32 [R, V] occurrences in the output so far
    seen: torch.Tensor | None  # bool [R, V] in prompt or output (repetition only)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for K samples, built once per step by `build`.

    Every optional tensor is None when no row uses the feature, so the sampler skips it.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor | None  # bool [K], only for a mixed batch
    temperature: torch.Tensor | None  # float32 [K, 1]; 1.0 on greedy rows
    top_k: torch.Tensor | None  # int64 [K]; 0 = off
    max_top_k: int
    top_p: torch.Tensor | None  # float32 [K]; 1.0 = off
    min_p: torch.Tensor | None  # float32 [K]; 0.0 = off
    penalties: PenaltyBatch | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked by min_tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # (rows [A], bool [A, V]) allowed_token_ids
    bad_words: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) banned by bad_words
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, biases)
    seeds: list[tuple[int, int]]  # (row, generator seed) of seeded random rows
    max_num_logprobs: int | None  # largest `logprobs` asked; None: no row asked

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        seq_index: Sequence[int],
        *,
        vocab_size: int,
        stop_token_ids: Sequence[Collection[int]],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Gather row parameters. Row i samples for a sequence with `params[i]`, tokens generated
        so far `output_token_ids[i]` (before this step), prompt `prompt_token_ids[i]` and index
        `seq_index[i]` in its request. The token lists are only read for rows using penalties.
        `stop_token_ids[i]` is every id that ends row i's sequence (its request's stop-token set,
        `SamplingParams.all_stop_token_ids` of the checkpoint's EOS ids): `min_tokens` masks
        exactly those."""
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
            banned=_min_tokens_ban(params, output_token_ids, stop_token_ids, vocab_size, device),
            allowed=_allowed(params, vocab_size, device),
            bad_words=_bad_words_ban(params, output_token_ids, vocab_size, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            seeds=[
                (i, sample_seed(params[i].seed, seq_index[i], len(output_token_ids[i])))
                for i in random_rows
                if params[i].seed is not None
            ],
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
    values = [
        0 if g or not p.uses_top_k or p.top_k >= vocab_size else p.top_k
        for p, g in zip(params, greedy)
    ]
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


def _penalties(
    params, output_token_ids, prompt_token_ids, vocab_size, device
) -> PenaltyBatch | None:
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
        seen = (_token_counts([prompt_token_ids[i] for i in rows], vocab_size, device) > 0) | (
            counts > 0
        )
    row_index = (
        None if len(rows) == len(params) else torch.tensor(rows, dtype=torch.int64, device=device)
    )
    return PenaltyBatch(
        row_index, column("presence_penalty"), column("frequency_penalty"), repetition, counts, seen
    )


def _index_pairs(rows: list[int], tokens: list[int], device):
    """(rows, tokens) as the int64 index pair `index_put` takes; None when there is none."""
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
    )


def _min_tokens_ban(params, output_token_ids, stop_token_ids, vocab_size, device):
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) < p.min_tokens:
            for t in stop_token_ids[i]:
                if t < vocab_size:  # an id the model cannot produce needs no mask
                    rows.append(i)
                    tokens.append(t)
    return _index_pairs(rows, tokens, device)


def _allowed(params, vocab_size, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    pairs = [(r, t) for r, i in enumerate(rows) for t in params[i].allowed_token_ids]
    pairs = [(r, t) for r, t in pairs if t < vocab_size]  # ids the model cannot produce
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    if pairs:
        index = torch.tensor(pairs, dtype=torch.int64, device=device)
        mask[index[:, 0], index[:, 1]] = True
    return torch.tensor(rows, dtype=torch.int64, device=device), mask


def _bad_words_ban(params, output_token_ids, vocab_size, device):
    """vLLM's rule: a one-token word is always banned; a longer word's last token is banned when
    the output so far ends with the word's other tokens."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, p in enumerate(params):
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            output = output_token_ids[i]
            if word[-1] < vocab_size and (
                not prefix
                or (len(output) >= len(prefix) and list(output[-len(prefix) :]) == prefix)
            ):
                rows.append(i)
                tokens.append(word[-1])
    return _index_pairs(rows, tokens, device)


def _logit_bias(params, vocab_size, device):
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        for t, bias in (p.logit_bias or {}).items():
            if t < vocab_size:
                rows.append(i)
                tokens.append(t)
                biases.append(bias)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
        torch.tensor(biases, dtype=torch.float32, device=device),
    )
