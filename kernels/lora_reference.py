"""Batched LoRA products over a step's tokens, grouped by adapter slot: the torch reference of
`kernels/lora.py` and the engine's CPU path.

A step mixes tokens of several adapters (and of none). Each token carries its adapter's device
slot (-1: no adapter). `LoRASegments` groups the tokens that have an adapter by slot once per
step (on the host, with numpy), and every adapted projection of every layer reuses it:

- shrink: `y[t] = x[t] @ A[slot(t)].T`  (`A [S, N, K]`: N = rank rows, stacked over the parts
  of a fused projection)
- expand: `out[t, o:o+N] += y[t, r:r+R] @ B[slot(t)].T`  (`B [S, N, R]`, the LoRA scaling folded
  in)

Tokens without an adapter are in no segment: their rows of `y` are never written or read, and
their rows of `out` are left as the base projection made them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class LoRASegments:
    """The tokens of a step that have an adapter, sorted by slot (stable: batch order within a
    slot), as segments `token_order[seg_starts[g]:seg_starts[g + 1]]` of slot `seg_slots[g]`."""

    token_order: Tensor  # int64 [N_lora] token rows, on the model's device
    seg_starts: Tensor  # int32 [G + 1]
    seg_slots: Tensor  # int32 [G]
    max_seg_len: int
    # host copies of the segments for the torch path: (slot, token rows) per segment
    groups: list[tuple[int, Tensor]]
    num_tokens: int  # T, the step's tokens (with or without an adapter)

    @property
    def single_slot(self) -> int | None:
        """The slot when every token of the step has that one adapter (products without any
        gather or scatter), else None."""
        if len(self.groups) == 1 and self.token_order.numel() == self.num_tokens:
            return self.groups[0][0]
        return None


def build_segments(token_slots: np.ndarray, device: torch.device) -> LoRASegments | None:
    """Segments of a step from its per-token slots `[T]` (-1 = no adapter); None when no token
    has an adapter (the LoRA products are skipped altogether)."""
    token_slots = np.asarray(token_slots)
    rows = np.flatnonzero(token_slots >= 0)
    if rows.size == 0:
        return None
    order = rows[np.argsort(token_slots[rows], kind="stable")]
    sorted_slots = token_slots[order]
    cuts = np.flatnonzero(np.diff(sorted_slots)) + 1
    starts = np.concatenate(([0], cuts, [order.size])).astype(np.int32)
    slots = sorted_slots[starts[:-1]].astype(np.int32)
    token_order = torch.from_numpy(order.astype(np.int64)).to(device)
    groups = [
        (int(slot), token_order[starts[g] : starts[g + 1]]) for g, slot in enumerate(slots.tolist())
    ]
    return LoRASegments(
        token_order=token_order,
        seg_starts=torch.from_numpy(starts).to(device),
        seg_slots=torch.from_numpy(slots).to(device),
        max_seg_len=int(np.diff(starts).max()),
        groups=groups,
        num_tokens=int(token_slots.size),
    )


def lora_shrink(x: Tensor, a: Tensor, seg: LoRASegments) -> Tensor:
    """x `[T, K]`, a `[S, N, K]` -> float32 `[T, N]` (rows of tokens without an adapter are
    unspecified)."""
    slot = seg.single_slot
    if slot is not None:
        return x.float() @ a[slot].float().t()
    y = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in seg.groups:
        y[rows] = x.index_select(0, rows).float() @ a[slot].float().t()
    return y


def lora_expand(
    y: Tensor, b: Tensor, seg: LoRASegments, out: Tensor, y_offset: int, out_offset: int
) -> None:
    """out[t, out_offset:out_offset+N] += y[t, y_offset:y_offset+R] @ b[slot(t)].T, in place,
    for every token with an adapter; b `[S, N, R]`."""
    n, r = b.shape[1], b.shape[2]
    target = out[:, out_offset : out_offset + n]
    slot = seg.single_slot
    if slot is not None:
        target += (y[:, y_offset : y_offset + r] @ b[slot].float().t()).to(out.dtype)
        return
    for slot, rows in seg.groups:
        delta = y[rows, y_offset : y_offset + r] @ b[slot].float().t()
        target.index_add_(0, rows, delta.to(out.dtype))
