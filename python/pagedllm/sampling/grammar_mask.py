"""Structured output's token mask, applied to the logits before any other sampling step.

The grammar engine (llguidance) fills one bitmask row per constrained sample: int32 words, bit
j of word w allowing token 32 * w + j. Here the rows are unpacked on the logits' device and
every disallowed token of those samples gets -inf; rows of free samples are untouched. Ids past
the mask's width (a model vocabulary wider than the tokenizer's) are disallowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """The step's mask: `rows` (int64 [G]) are the logits rows sampled under a grammar, `bits`
    (int32 [G, W]) their allowed tokens."""

    rows: torch.Tensor
    bits: torch.Tensor

    def subset(self, rows: list[int]) -> TokenBitmask | None:
        """The mask for `logits[rows]` (a step's sampling retried row by row), or None."""
        position = {r: g for g, r in enumerate(self.rows.tolist())}
        picked = [(i, position[r]) for i, r in enumerate(rows) if r in position]
        if not picked:
            return None
        new_rows, old = zip(*picked)
        return TokenBitmask(torch.tensor(new_rows), self.bits[list(old)])


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [G, vocab_size] from int32 [G, W] bitmask words."""
    return ~disallowed_tokens(bits, vocab_size)


def disallowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [G, vocab_size]: True where the mask forbids the token (ids past the mask too)."""
    # bit j of each word: 1 << j as int32 (bit 31 is the sign bit: -2**31)
    powers = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)
    banned = ((bits.unsqueeze(-1) & powers.to(bits.device)) == 0).flatten(1)
    width = banned.shape[1]
    if width >= vocab_size:
        return banned[:, :vocab_size]
    return torch.nn.functional.pad(banned, (0, vocab_size - width), value=True)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`logits` [K, V] with the disallowed tokens of the masked rows at -inf (a new tensor:
    the caller's logits are left as they are)."""
    device = logits.device
    banned = disallowed_tokens(mask.bits.to(device, non_blocking=True), logits.shape[1])
    num_rows = mask.rows.shape[0]
    if num_rows == logits.shape[0] and bool((mask.rows == torch.arange(num_rows)).all()):
        # every row constrained (in order): one masked fill, no gather / scatter of rows
        return logits.masked_fill(banned, float("-inf"))
    rows = mask.rows.to(device, non_blocking=True)
    out = logits.clone()
    out[rows] = out[rows].masked_fill_(banned, float("-inf"))
    return out
