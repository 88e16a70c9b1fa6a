"""pagedllm: a compact, fast LLM inference engine.

The memory manager and scheduler are Rust (`pagedllm._core`); the model side is torch.
Public names are resolved lazily so that `import pagedllm` never imports torch or needs a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedllm.worker.cpu_threads import prefer_passive_openmp

__version__ = "0.1.0"

# before anything imports torch: libgomp reads its wait policy once, at load
prefer_passive_openmp()

# public name -> module that defines it
_LAZY = {
    "KVCacheManager": "pagedllm._core",
    "AllocStatus": "pagedllm._core",
    "PagedLLMError": "pagedllm._core",
    "Scheduler": "pagedllm._core",
    "SchedulerOutput": "pagedllm._core",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "EngineArgs": "pagedllm.config",
    "LLMEngine": "pagedllm.engine",
    "LLM": "pagedllm.llm",
    "LoRARequest": "pagedllm.lora.request",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
