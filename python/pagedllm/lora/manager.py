"""`LoRAManager`: the engine's one object for adapters — checks and loads them when a request
names one (before it is queued), keeps them in the host LRU and the device slots, puts each
step's adapters into slots before the step runs (`load_step`: an adapter evicted from the host
LRU is read from its folder again there, and one that can no longer be read fails its requests,
not the step), and turns the step's per-row adapter ids (`SchedulerOutput.lora_ids`) into the
token segments the wrapped projections read.

Adapters loaded and unloaded while serving (`read` off the engine thread, then `install`; `retire`
and `free_retired`) take the same host LRU and slots, always under an id never used before.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.kernels.lora_reference import build_segments
from pagedllm.lora.adapter import PROJECTIONS, LoRAAdapter, ModelLoRASpec
from pagedllm.lora.host_cache import HostAdapterCache
from pagedllm.lora.layers import LoRAState, wrap_projections
from pagedllm.lora.peft_loader import load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slots import LoRASlots
from pagedllm.models.layout import shard_of


class LoRAManager:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.spec = ModelLoRASpec.of(model.config)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        # every adapter a request has named: id -> request (an id always names one adapter)
        self.requests: dict[int, LoRARequest] = {}
        self.host = HostAdapterCache(max_cpu_loras, self.read)
        # unloaded adapters whose requests have not all finished: freed once they have
        self.retired: set[int] = set()
        # tensor parallelism: this rank's shard of each adapter, cut like the model's weights;
        # rank 0 records its slot loads for the other ranks (`take_loads` / `place`)
        tp = model.tp
        self.slots = LoRASlots(
            self.spec,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            dtype=dtype,
            device=device,
            shards={part: shard_of(model.config, f"{part}.weight", tp) for part in PROJECTIONS},
            record_loads=tp.size > 1 and tp.rank == 0,
        )
        self.state = LoRAState(self.slots)
        wrap_projections(model, self.state)

    def add(self, request: LoRARequest) -> int:
        """Checks and loads `request`'s adapter (ValueError naming it when its folder is bad or
        its id already names another adapter); returns the id the scheduler carries."""
        if not isinstance(request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest, got {type(request).__name__} {request!r}"
            )
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (
            request.lora_name,
            request.lora_path,
        ):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: lora_int_id={request.lora_int_id} already "
                f"names adapter {known.lora_name!r} ({known.lora_path})"
            )
        if known is None or request.lora_int_id not in self.host:
            self.host.get(request)
        self.requests[request.lora_int_id] = request
        return request.lora_int_id

    def list_loras(self) -> set[int]:
        """Ids of the adapters requests have named."""
        return set(self.requests)

    def install(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """An adapter loaded at run time, already read and checked by `read` off the engine
        thread: the engine thread only puts it in the host LRU (no disk read inside a step)."""
        if request.lora_int_id in self.requests:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: lora_int_id={request.lora_int_id} is "
                f"already taken"
            )
        self.requests[request.lora_int_id] = request
        self.host.put(adapter)

    def retire(self, lora_int_id: int) -> None:
        """An unloaded adapter: freed by `free_retired` once no unfinished request uses it."""
        if lora_int_id in self.requests:
            self.retired.add(lora_int_id)

    def free_retired(self, in_use: set[int]) -> None:
        """Drops the retired adapters not in `in_use` (ids of unfinished requests' adapters)
        from the host LRU and the device slots."""
        for lora_int_id in self.retired - in_use:
            self.retired.discard(lora_int_id)
            self.requests.pop(lora_int_id, None)
            self.host.discard(lora_int_id)
            self.slots.discard(lora_int_id)

    def load_step(self, lora_ids: np.ndarray) -> dict[int, ValueError]:
        """Puts the adapters of a step's rows (`lora_ids [S]`) into device slots, before anything
        of the step runs: one no longer in a slot nor in the host LRU is read from its folder
        again. Returns those that can no longer be read (folder deleted or changed since it was
        added): `{lora_int_id: ValueError naming the adapter}`; their requests cannot run, the
        others' adapters are in slots."""
        lost: dict[int, ValueError] = {}
        ready = []
        for lora_id in np.unique(lora_ids).tolist():
            if lora_id == 0:
                continue
            if lora_id not in self.slots:
                try:
                    self._fetch(lora_id)
                except ValueError as exc:
                    lost[lora_id] = exc
                    continue
            ready.append(lora_id)
        self.slots.assign(ready, self._fetch)
        return lost

    def prepare_step(self, lora_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Builds the token segments of a step (or of some of its rows) from the per-row adapter
        ids `[S]` and token counts `[S]`, their adapters already in slots (`load_step`: nothing
        is read from disk inside a step). Array ops; a Python loop only over the distinct
        adapters, at most `max_loras`."""
        lora_ids = np.asarray(lora_ids)
        if not lora_ids.any():
            self.state.segments = None  # no row has an adapter: the projections skip LoRA
            return
        distinct, inverse = np.unique(lora_ids, return_inverse=True)
        adapters = [int(i) for i in distinct.tolist() if i != 0]
        slot_of = self.slots.slots_of(adapters)
        lookup = np.array([slot_of.get(int(i), -1) for i in distinct.tolist()], dtype=np.int64)
        token_slots = np.repeat(lookup[inverse.reshape(-1)], np.asarray(num_tokens))
        self.state.segments = build_segments(token_slots, self.device)

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """Rank 0 under tensor parallelism: (slot, adapter) of each slot load since the last
        call, for the other ranks to `place` before they run the same rows."""
        return [(slot, self.requests[i]) for slot, i in self.slots.take_loads()]

    def place(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Another rank's copy of rank 0's slot loads (its own shard of each adapter)."""
        for slot, request in loads:
            self.requests[request.lora_int_id] = request
            self.slots.place(slot, self.host.get(request))

    def _fetch(self, lora_int_id: int) -> LoRAAdapter:
        return self.host.get(self.requests[lora_int_id])

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Reads and checks `request`'s folder (ValueError naming the problem); touches no
        engine state, so it may run in any thread."""
        return load_peft_adapter(request, self.spec, self.max_lora_rank, self.dtype)
