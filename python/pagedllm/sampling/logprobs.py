"""Logprobs of the raw model distribution (`log_softmax(logits)` before any sampling transform):
the sampled token's logprob and rank, and the top-N, on the device; copied to the host once per
step (`tolists`) to build vLLM's per-token `Logprob` dicts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.outputs import Logprob


@dataclass
class LogprobsTensors:
    """Raw-distribution logprobs of a step, on the logits' device."""

    sampled_logprobs: torch.Tensor  # float32 [K]
    sampled_ranks: torch.Tensor  # int64 [K], 1 = most likely token
    top_token_ids: torch.Tensor  # int64 [K, N], N = largest `logprobs` asked
    top_logprobs: torch.Tensor  # float32 [K, N]

    def tolists(self) -> LogprobsLists:
        """Copy to host once per step (one sync), for building `Logprob` dicts."""
        return LogprobsLists(
            self.sampled_logprobs.tolist(),
            self.sampled_ranks.tolist(),
            self.top_token_ids.tolist(),
            self.top_logprobs.tolist(),
        )


@dataclass
class LogprobsLists:
    sampled_logprobs: list[float]
    sampled_ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def entry(
        self, row: int, token_id: int, num_logprobs: int, decode: Callable[[int], str] | None = None
    ) -> dict[int, Logprob]:
        """vLLM's per-token logprobs dict: the sampled token plus the `num_logprobs` most likely
        (so num_logprobs or num_logprobs + 1 entries)."""

        def make(lp: float, rank: int, tid: int) -> Logprob:
            return Logprob(lp, rank, decode(tid) if decode is not None else None)

        out = {token_id: make(self.sampled_logprobs[row], self.sampled_ranks[row], token_id)}
        ids, lps = self.top_token_ids[row], self.top_logprobs[row]
        for rank, (tid, lp) in enumerate(zip(ids[:num_logprobs], lps[:num_logprobs]), start=1):
            out.setdefault(tid, make(lp, rank, tid))
        return out


def compute_logprobs(
    raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> LogprobsTensors:
    sampled = raw_logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    top = raw_logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(sampled.squeeze(1), ranks, top.indices, top.values)
