"""The `max_loras` device slots: every adapted projection's A and B matrices of all slots,
stacked in one buffer per fused layer (A) and per projection (B), zero-padded to
`max_lora_rank`. A padded rank or a projection an adapter does not target stays zero, so it
adds nothing.

A fused layer's A stacks its parts' ranks: `qkv_proj` A is `[L, S, 3 * R, hidden]` with q's
rows first, so one shrink serves q, k and v; each part's B `[L, S, out, R]` expands its share
into its columns of the fused output.

Under tensor parallelism each rank's slots hold its shard of every adapter, cut the way vLLM
cuts them, by the rule its base weights are cut by (`models.layout.shard_of`): a
column-parallel projection (q/k/v, gate/up) keeps A whole and its B rows of this rank's output
columns; a row-parallel one (o, down) keeps its A columns of this rank's input and B whole (its
delta is a partial sum, reduced with the base output's). Rank 0 decides which adapter goes in
which slot; its `loads` (kept only when asked for) are what the other ranks `place` in theirs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from pagedllm.lora.adapter import FUSED_PARTS, LoRAAdapter, ModelLoRASpec


class LoRASlots:
    def __init__(
        self,
        spec: ModelLoRASpec,
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        shards: dict[str, tuple[int, slice] | None] | None = None,
        record_loads: bool = False,
    ) -> None:
        """`shards`: per projection, (axis, slice) of its base weight `[out, in]` this rank
        holds (None: all of it); `record_loads`: keep `loads` for the other ranks."""
        self.max_loras, self.rank = max_loras, max_lora_rank
        num_layers, r = spec.num_layers, max_lora_rank
        # per projection: (A's column slice, B's row slice), None where whole
        self._cuts = {part: _cuts((shards or {}).get(part)) for part in spec.shapes}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for fused, parts in FUSED_PARTS.items():
            d_in = _length(spec.shapes[parts[0]][0], self._cuts[parts[0]][0])
            shape = (num_layers, max_loras, len(parts) * r, d_in)
            self.a[fused] = torch.zeros(shape, dtype=dtype, device=device)
            for part in parts:
                d_out = _length(spec.shapes[part][1], self._cuts[part][1])
                self.b[part] = torch.zeros(
                    (num_layers, max_loras, d_out, r), dtype=dtype, device=device
                )
        # where each part's rows sit in its fused layer's A
        self._a_rows = {
            part: (fused, j * r)
            for fused, parts in FUSED_PARTS.items()
            for j, part in enumerate(parts)
        }
        # lora_int_id -> slot, least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self.num_loads = 0
        # (slot, lora_int_id) of each load since the last `take_loads` (when recording)
        self.loads: list[tuple[int, int]] | None = [] if record_loads else None

    def assign(self, lora_ids: list[int], fetch: Callable[[int], LoRAAdapter]) -> dict[int, int]:
        """Slots for this step's distinct adapters (at most `max_loras`), loading the missing ones
        into the least recently used slots that this step does not need."""
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(
                f"a step holds {len(lora_ids)} adapters, more than max_loras={self.max_loras}"
            )
        needed = set(lora_ids)
        for lora_id in lora_ids:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            self._load(self._free_slot(needed), fetch(lora_id))
        return {lora_id: self._slot_of[lora_id] for lora_id in lora_ids}

    def slots_of(self, lora_ids: list[int]) -> dict[int, int]:
        """Slots of adapters already in slots (`assign`); a RuntimeError for one that is not."""
        missing = [i for i in lora_ids if i not in self._slot_of]
        if missing:
            raise RuntimeError(
                f"LoRA adapters {missing} are not in device slots (LoRAManager.load_step loads a "
                f"step's adapters before it runs)"
            )
        return {lora_id: self._slot_of[lora_id] for lora_id in lora_ids}

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._slot_of

    def discard(self, lora_id: int) -> None:
        """Frees the slot of an unloaded adapter (its stale rows are never read: no step's
        segments point at a slot without an adapter, and the next load zeroes it)."""
        self._slot_of.pop(lora_id, None)

    def resident(self) -> list[int]:
        """Adapter ids in device slots, least recently used first."""
        return list(self._slot_of)

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self._slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(i for i in self._slot_of if i not in needed)
        return self._slot_of.pop(victim)

    def take_loads(self) -> list[tuple[int, int]]:
        """(slot, lora_int_id) of the loads since the last call, in order (needs
        `record_loads`)."""
        loads, self.loads = self.loads, []
        return loads

    def place(self, slot: int, adapter: LoRAAdapter) -> None:
        """Load `adapter` into `slot`, as another rank decided (its previous adapter goes)."""
        for lora_id, held in list(self._slot_of.items()):
            if held == slot:
                del self._slot_of[lora_id]
        self._load(slot, adapter)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for buffer in (*self.a.values(), *self.b.values()):
            buffer[:, slot].zero_()
        r = adapter.rank
        for (layer, part), (a, b) in adapter.weights.items():
            fused, row = self._a_rows[part]
            a_cols, b_rows = self._cuts[part]
            a = a if a_cols is None else a[:, a_cols]
            b = b if b_rows is None else b[b_rows]
            self.a[fused][layer, slot, row : row + r].copy_(a, non_blocking=True)
            self.b[part][layer, slot, :, :r].copy_(b, non_blocking=True)
        self._slot_of[adapter.lora_int_id] = slot
        self.num_loads += 1
        if self.loads is not None:
            self.loads.append((slot, adapter.lora_int_id))


def _cuts(shard: tuple[int, slice] | None) -> tuple[slice | None, slice | None]:
    """A base weight `[out, in]` cut on its rows (output: column-parallel) cuts B's rows; cut
    on its columns (input: row-parallel), A's columns."""
    if shard is None:
        return None, None
    axis, cut = shard
    return (None, cut) if axis == 0 else (cut, None)


def _length(size: int, cut: slice | None) -> int:
    return size if cut is None else len(range(size)[cut])
