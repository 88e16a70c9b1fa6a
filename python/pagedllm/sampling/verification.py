"""The rows of a verification step (speculative decoding): sample `i` with drafts
`x_0 .. x_{d-1}` is scored at `d + 1` positions, and position `j` is sampled as the token after
the sequence extended by `x_0 .. x_{j-1}`. Its row therefore sees those drafts as output tokens:
penalties count them, `min_tokens` is judged on the longer output, and a seeded row's seed is
that of the token index it decides (`seeds.sample_seed`), exactly as plain decoding would have
seen that position.

Below both the model runner (which picks the hidden-state rows to score,
`verification_logits_rows`) and `spec_decode` (which verifies them), so neither imports the
other."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


def has_drafts(step) -> bool:
    """Whether the scheduled step carries draft tokens to verify."""
    return len(step.spec_draft_token_ids) > 0


def verification_rows(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
    seq_index: Sequence[int],
    drafts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    stop_token_ids: Sequence[Collection[int]],
    device: torch.device | str,
) -> SamplingMetadata:
    """`SamplingMetadata` of `sum(len(drafts[i]) + 1)` rows: sample `i`'s positions in order,
    each with the output extended by the drafts before it (see the module doc)."""
    rows_params, rows_output, rows_prompt, rows_index, rows_stop = [], [], [], [], []
    for i, draft in enumerate(drafts):
        output = list(output_token_ids[i])
        for j in range(len(draft) + 1):
            rows_params.append(params[i])
            rows_output.append(output + list(draft[:j]) if j else output)
            rows_prompt.append(prompt_token_ids[i])
            rows_index.append(seq_index[i])
            rows_stop.append(stop_token_ids[i])
    return SamplingMetadata.build(
        rows_params,
        rows_output,
        rows_prompt,
        rows_index,
        vocab_size=vocab_size,
        stop_token_ids=rows_stop,
        device=device,
    )


def verification_logits_rows(last_rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """int64 [sum(d + 1)] hidden-state rows to score: sample `k`, whose row's last token is
    `last_rows[k]` and whose last `num_drafts[k]` tokens are drafts, is scored at its last
    `d + 1` positions (the row's own token, then each draft), in order."""
    d = num_drafts.astype(np.int64)
    counts = d + 1
    first = np.repeat(last_rows.astype(np.int64) - d, counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    return first + within
