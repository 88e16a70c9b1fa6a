"""Engine knobs (`EngineArgs`), shared by `LLM(...)`, `LLMEngine` and the CLI."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# the built-in model (no files: seeded random weights over a byte vocabulary)
TINY_RANDOM_MODEL = "pagedllm/tiny-random"
DEFAULT_MODEL = TINY_RANDOM_MODEL
SCHEDULING_STRATEGIES = ("unified", "prefill_first", "chunked_prefill")
POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = (None, "recompute", "swap")
DTYPES = ("auto", "float32", "float16", "bfloat16")
GiB = 1 << 30


@dataclass
class EngineArgs:
    """Every engine knob, with vLLM's names. `LLM(model, **knobs)` builds one of these."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    cpu_kv_cache_space: float = 1.0  # GiB for the KV cache when running on CPU
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    scheduling: str = "unified"
    policy: str = "fcfs"
    preemption_mode: str | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    long_prefill_token_threshold: int = 0
    delay_factor: float = 0.0
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    disable_log_stats: bool = True
    stats_log_interval: float = 5.0  # seconds between periodic stats log lines

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _one_of("scheduling", self.scheduling, SCHEDULING_STRATEGIES)
        _one_of("policy", self.policy, POLICIES)
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("dtype", self.dtype, DTYPES)
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        for name in ("num_gpu_blocks", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in (
            "swap_space",
            "cpu_kv_cache_space",
            "delay_factor",
            "long_prefill_token_threshold",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """prefill_first never splits a prompt, so by default its budget holds a whole one."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.scheduling == "prefill_first":
            return max(max_model_len, 2048)
        return 8192


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
