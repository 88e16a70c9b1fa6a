"""Speculative decoding under a grammar (vLLM V1's way).

- Before a step: a constrained sequence's drafts are cut to the longest prefix its matcher
  accepts (`grammar_valid_prefix`, `cut_drafts`): a draft the grammar rejects would be
  rejected by verification anyway, so it is not scheduled at all.
- Verification: a constrained sample with `d` drafts gets `d + 1` bitmask rows, row `j` its
  grammar's mask after drafts `0 .. j-1` (llguidance fills them in one call, consuming the
  drafts tentatively and rolling them back), and the verifier sees the masked target logits
  at each position (`mask_rows` places the rows): the target distribution is the grammar-masked one,
  and every token a run emits is grammar-valid.
- After verification the matcher advances over every token each run kept
  (`StructuredOutputManager.advance`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np


def grammar_valid_prefix(matcher, drafts: Sequence[int], eos_token_ids: Collection[int]) -> int:
    """How many of `drafts` (from the matcher's state) to keep: the longest prefix the grammar
    accepts, without a closing EOS (the grammar has nothing to mask after it, and verification
    draws the EOS itself where the grammar allows it)."""
    if not drafts:
        return 0
    n = matcher.validate_tokens(drafts)
    # only EOS can follow a finished grammar, so an EOS it accepts is the last accepted draft
    if n and drafts[n - 1] in eos_token_ids:
        n -= 1
    return n


def cut_drafts(
    seq_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    draft_token_ids: np.ndarray,
    matchers: Mapping[int, object],
    eos_token_ids: Collection[int],
    counts_into=None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Drafts in `Scheduler.propose_drafts`' form with each constrained sequence's run
    (`matchers`: sequence id -> its matcher; the other sequences are free) cut to what its
    grammar accepts; None when nothing was cut (the scheduler's drafts stand as they are).
    `counts_into` (a `DraftCuts`) adds the constrained drafts proposed and kept."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    counts = np.asarray(num_draft_tokens, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    keep = counts.copy()
    known = np.fromiter(matchers, dtype=np.int64, count=len(matchers))
    constrained = np.flatnonzero(np.isin(seq_ids, known))
    for i in constrained.tolist():
        run = draft_token_ids[starts[i] : starts[i] + counts[i]].tolist()
        keep[i] = grammar_valid_prefix(matchers[int(seq_ids[i])], run, eos_token_ids)
    if counts_into is not None:
        counts_into.proposed += int(counts[constrained].sum())
        counts_into.kept += int(keep[constrained].sum())
    if np.array_equal(keep, counts):
        return None
    kept_tokens = _within(counts) < np.repeat(keep, counts)
    return (
        seq_ids,
        keep,
        np.asarray(draft_token_ids, dtype=np.int64)[kept_tokens],
    )


def mask_rows(
    constrained: Sequence[int], num_drafts: np.ndarray, samples: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Where a verification step's grammar masks go. `constrained`: the constrained samples
    (sample order), whose bitmask holds `num_drafts[k] + 1` rows each, in that order;
    `num_drafts` [K]: every sample's drafts. Verification's logits hold the `d + 1` positions
    of each of `samples` (all K when None) in order. Returns (logits rows, bitmask rows) of
    the masked positions, paired."""
    d = np.asarray(num_drafts, dtype=np.int64)
    rows = np.asarray(constrained, dtype=np.int64)
    counts = d[rows] + 1
    block_start = np.cumsum(counts) - counts  # each constrained sample's first bitmask row
    if samples is None:
        logit_start = (np.cumsum(d + 1) - (d + 1))[rows]
        bit_rows = np.arange(int(counts.sum()), dtype=np.int64)
    else:
        picked = np.asarray(samples, dtype=np.int64)
        sample_start = np.cumsum(d[picked] + 1) - (d[picked] + 1)
        position = {k: i for i, k in enumerate(picked.tolist())}
        keep = np.array([k in position for k in rows.tolist()], dtype=bool)
        rows, counts, block_start = rows[keep], counts[keep], block_start[keep]
        logit_start = sample_start[[position[k] for k in rows.tolist()]].astype(np.int64)
        bit_rows = np.repeat(block_start, counts) + _within(counts)
    logit_rows = np.repeat(logit_start, counts) + _within(counts)
    return logit_rows, bit_rows


def _within(counts: np.ndarray) -> np.ndarray:
    """0 .. c-1 for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
