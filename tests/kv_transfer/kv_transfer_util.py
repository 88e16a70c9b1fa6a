"""Helpers of the KV transfer tests."""

from __future__ import annotations

import threading

from pagedllm import LLM


class GatedLoads:
    """Holds the copy thread's loads until `release()` (a slow tier)."""

    def __init__(self, llm: LLM) -> None:
        self.gate = threading.Event()
        connector = llm.llm_engine.kv_transfer
        load = connector._load

        def gated(*args):
            if len(args[0]):
                self.gate.wait(10)
            return load(*args)

        connector._load = gated

    def release(self) -> None:
        self.gate.set()
