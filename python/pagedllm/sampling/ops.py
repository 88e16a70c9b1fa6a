"""Logits processing on whole [K, V] tensors: allowed tokens, penalties, min-p, top-k, top-p;
argmax."""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedllm import _core
from pagedllm.sampling.metadata import PenaltyBatch


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Rows `rows` keep only their `allowed` tokens (bool [A, V]); the others get -inf."""
    return logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(~allowed, -math.inf))


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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then nucleus filtering with one ascending sort. A token survives top-p when the
    tokens more likely than it hold less than top_p of the mass; the top token always does."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)
        position = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(
            position < (vocab - k).unsqueeze(1), float("-inf")
        )
    mass_up_to = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = mass_up_to <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [K]: each row's argmax (the first on ties, the first NaN if any, as `torch.argmax`),
    for the greedy choice and the exponential race. float32 on the CPU goes through the Rust
    kernel (`rust/src/cpu/argmax.rs`): torch's CPU argmax does not vectorize its index
    bookkeeping (~2 ns a logit on a 2-core Zen 3, ~0.5 ms for eight rows of a 32k vocabulary)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return logits.argmax(dim=-1)
    rows = logits.contiguous().numpy()
    out = np.empty(rows.shape[0], dtype=np.int64)
    _core.cpu_argmax(rows, out, torch.get_num_threads())
    return torch.from_numpy(out)
