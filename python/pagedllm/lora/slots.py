"""The `max_loras` device slots: every adapted projection's A and B matrices of all slots,
stacked in one buffer per fused layer (A) and per projection (B), zero-padded to
`max_lora_rank`. A padded rank or a projection an adapter does not target stays zero, so it
adds nothing.

A fused layer's A stacks its parts' ranks: `qkv_proj` A is `[L, S, 3 * R, hidden]` with q's
rows first, so one shrink serves q, k and v; each part's B `[L, S, out, R]` expands its share
into its columns of the fused output.
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
    ) -> None:
        self.max_loras, self.rank = max_loras, max_lora_rank
        num_layers, r = spec.num_layers, max_lora_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for fused, parts in FUSED_PARTS.items():
            d_in = spec.shapes[parts[0]][0]
            shape = (num_layers, max_loras, len(parts) * r, d_in)
            self.a[fused] = torch.zeros(shape, dtype=dtype, device=device)
            for part in parts:
                d_out = spec.shapes[part][1]
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

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for buffer in (*self.a.values(), *self.b.values()):
            buffer[:, slot].zero_()
        r = adapter.rank
        for (layer, part), (a, b) in adapter.weights.items():
            fused, row = self._a_rows[part]
            self.a[fused][layer, slot, row : row + r].copy_(a, non_blocking=True)
            self.b[part][layer, slot, :, :r].copy_(b, non_blocking=True)
        self._slot_of[adapter.lora_int_id] = slot
        self.num_loads += 1
