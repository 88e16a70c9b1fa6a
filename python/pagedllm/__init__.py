"""pagedllm: a compact, fast LLM inference engine.

The memory manager and scheduler are Rust (`pagedllm._core`); the model side is torch.
Public names are resolved lazily so that `import pagedllm` never imports torch or needs a GPU.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# variables by which a user chooses libgomp's wait policy themselves
_WAIT_POLICY_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _prefer_passive_openmp() -> None:
    """Sets OMP_WAIT_POLICY=PASSIVE unless a wait policy is already chosen (the why:
    `worker/cpu_threads.py`). Here, not there: every module's import runs this file first, so it
    imports no module of the package (the layering test's no-circle rule)."""
    if not any(os.environ.get(name) for name in _WAIT_POLICY_ENV):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


# before anything imports torch: libgomp reads its wait policy once, at load
_prefer_passive_openmp()

# public name -> module that defines it
_LAZY = {
    "KVCacheManager": "pagedllm._core",
    "AllocStatus": "pagedllm._core",
    "PagedLLMError": "pagedllm._core",
    "Scheduler": "pagedllm._core",
    "SchedulerOutput": "pagedllm._core",
    "SamplingParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
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
