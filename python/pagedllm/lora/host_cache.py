"""The host-side LRU of loaded adapters (`max_cpu_loras` of them)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedllm.lora.adapter import LoRAAdapter
from pagedllm.lora.request import LoRARequest


class HostAdapterCache:
    """At most `capacity` adapters read from disk, least recently used evicted first. An evicted
    adapter is read again from its folder when a step needs it and it is not in a device slot."""

    def __init__(self, capacity: int, load: Callable[[LoRARequest], LoRAAdapter]) -> None:
        self.capacity = capacity
        self._load = load
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_loads = 0

    def get(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is not None:
            self._adapters.move_to_end(request.lora_int_id)
            return adapter
        adapter = self._load(request)  # raises ValueError on a bad folder: nothing is cached
        self.num_loads += 1
        self._adapters[request.lora_int_id] = adapter
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return adapter

    def put(self, adapter: LoRAAdapter) -> None:
        """An adapter read elsewhere (a load at run time reads it off the engine thread)."""
        self._adapters[adapter.lora_int_id] = adapter
        self._adapters.move_to_end(adapter.lora_int_id)
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)

    def discard(self, lora_int_id: int) -> None:
        self._adapters.pop(lora_int_id, None)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def ids(self) -> list[int]:
        """Cached adapter ids, least recently used first."""
        return list(self._adapters)
