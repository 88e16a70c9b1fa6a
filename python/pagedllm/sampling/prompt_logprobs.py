"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for each prompt token after the first,
its logprob and the N most likely tokens at its position, from the raw model distribution
(`log_softmax` of the logits, as vLLM).

The logits of position p score prompt token p + 1, so a request needs the logits of its prompt
positions 0 .. len - 2 (position len - 1 is the row sampled for the first output token). Each
step, `rows_of` picks those rows among the tokens the step computes (a chunked prefill brings
them over several steps), the model runner computes their logits in slices (`PromptRows.take`
reduces each slice to the few numbers kept, so a long prompt never holds [len, V] logits), and
`collect` turns them into vLLM's per-token `Logprob` dicts.

A cached prefix is never computed, so these requests get a prefix-cache key of their own
(`cache_salt`): they never hit blocks of other requests (vLLM likewise skips prefix-cache hits
for them), and their blocks are hit by nobody else. A recompute after a preemption finds the
positions already collected and skips them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams

PromptLogprobsList = list[dict[int, Logprob] | None]


@dataclass
class _Pending:
    token_ids: list[int]
    num: int  # top-N asked
    entries: PromptLogprobsList  # [None] * len; entry p + 1 from the logits of position p
    missing: int  # positions whose entry is still to come

    @property
    def complete(self) -> bool:
        return self.missing == 0


@dataclass
class PromptRows:
    """The prompt rows of one forward: hidden-state `rows` (in the forward's token layout) and,
    per row, its request and position. `take` reduces the logits of each slice of rows to the
    target token's logprob and rank and the top `max_num` logprobs; the runner calls it."""

    rows: np.ndarray  # int64 [P]
    request_ids: list[str]  # [P]
    positions: np.ndarray  # int64 [P]
    targets: np.ndarray  # int64 [P]: the prompt token each row scores
    max_num: int
    _parts: list[tuple[torch.Tensor, ...]] = field(default_factory=list)

    def take(self, logits: torch.Tensor, start: int) -> None:
        """Logits of rows [start, start + len(logits)), in order."""
        logprobs = logits.float().log_softmax(dim=-1)
        targets = torch.from_numpy(self.targets[start : start + len(logits)]).to(logits.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(self.max_num, dim=-1)
        self._parts.append((chosen.squeeze(1), ranks, top.indices, top.values))

    def results(self) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
        """(target logprob, target rank, top ids, top logprobs) per row, on the host."""
        if not self._parts:
            return [], [], [], []
        parts = [torch.cat(column) for column in zip(*self._parts)]
        return tuple(part.tolist() for part in parts)  # type: ignore[return-value]


class PromptLogprobs:
    """The prompt logprobs of the live requests that asked for them."""

    def __init__(self, decode: Callable[[int], str | None]) -> None:
        self._decode = decode
        self._pending: dict[str, _Pending] = {}
        self._salts = itertools.count(1)  # requests without prompt logprobs use key 0

    def cache_key(self, params: SamplingParams) -> int:
        """The prefix-cache key of a request (see the module doc): 0, the shared one, unless it
        asks for prompt logprobs."""
        return 0 if params.prompt_logprobs is None else next(self._salts)

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """Tracks a request that asks for prompt logprobs (others are not tracked)."""
        if params.prompt_logprobs is None:
            return
        entries: PromptLogprobsList = [None] * len(token_ids)
        self._pending[request_id] = _Pending(
            token_ids, params.prompt_logprobs, entries, len(token_ids) - 1
        )

    def result(self, request_id: str) -> PromptLogprobsList | None:
        """The request's prompt logprobs once every position is in (None before, or when it
        did not ask)."""
        pending = self._pending.get(request_id)
        return pending.entries if pending is not None and pending.complete else None

    def release(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def rows_of(self, step) -> PromptRows | None:
        """The rows of `step` (a scheduler step or a `StepRows`) whose logits a tracked request
        still needs; None when there are none (the usual case costs one dict check)."""
        if not self._pending:
            return None
        rows: list[np.ndarray] = []
        ids: list[str] = []
        starts = step.query_start_loc
        num_tokens = step.num_tokens
        positions = step.positions
        for i, request_id in enumerate(step.request_ids):
            pending = self._pending.get(request_id)
            if pending is None or not pending.missing:
                continue
            first, n = int(starts[i]), int(num_tokens[i])
            start = int(positions[first])
            # positions < len - 1 whose entry is still missing
            wanted = np.arange(start, min(start + n, len(pending.token_ids) - 1))
            wanted = wanted[[pending.entries[p + 1] is None for p in wanted]]
            if wanted.size:
                rows.append(first + wanted - start)
                ids.extend([request_id] * wanted.size)
        if not rows:
            return None
        token_rows = np.concatenate(rows).astype(np.int64)
        at = positions[token_rows].astype(np.int64)
        targets = np.array(
            [self._pending[r].token_ids[p + 1] for r, p in zip(ids, at.tolist())], dtype=np.int64
        )
        max_num = max(1, max(self._pending[r].num for r in set(ids)))
        return PromptRows(token_rows, ids, at, targets, max_num)

    def collect(self, prompt: PromptRows | None) -> None:
        """Stores what a forward computed for `prompt`'s rows."""
        if prompt is None:
            return
        chosen, ranks, top_ids, top_lps = prompt.results()
        for k, (request_id, position) in enumerate(zip(prompt.request_ids, prompt.positions)):
            pending = self._pending.get(request_id)
            if pending is None or pending.entries[position + 1] is not None:
                continue
            target = pending.token_ids[position + 1]
            entry = {target: Logprob(chosen[k], ranks[k], self._decode(target))}
            for rank, (tid, lp) in enumerate(
                zip(top_ids[k][: pending.num], top_lps[k][: pending.num]), start=1
            ):
                entry.setdefault(tid, Logprob(lp, rank, self._decode(tid)))
            pending.entries[position + 1] = entry
            pending.missing -= 1
