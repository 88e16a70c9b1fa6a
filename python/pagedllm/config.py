"""Engine knobs (`EngineArgs`), shared by `LLM(...)`, `LLMEngine` and the CLI.

The scheduler's and the cache's knobs (mode names, defaults, their rules, the default token
budget) are the Rust core's: read from and checked by `pagedllm._core`, never restated here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass

from pagedllm._core import (  # the mode names: re-exported for the CLI's choices
    DEFAULTS,
    MAX_ROUTER_REPLICAS,
    POLICIES,  # noqa: F401
    PREEMPTION_MODES,  # noqa: F401
    SCHEDULING_STRATEGIES,  # noqa: F401
    check_scheduler_config,
    default_max_num_batched_tokens,
)
from pagedllm.checkpoint.packaged import PACKAGED_MODELS, packaged_model_path
from pagedllm.kv_events.config import KVEventsConfig
from pagedllm.spec_decode.config import SpeculativeConfig

# the built-in model (no files: seeded random weights over a byte vocabulary)
TINY_RANDOM_MODEL = "pagedllm/tiny-random"
DEFAULT_MODEL = TINY_RANDOM_MODEL
# the dtypes the models run in (and a checkpoint may state); "auto" picks one per device
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPES = ("auto", *DTYPE_NAMES)
# quantization= (--quantization) -> the ggml type (GGML's numbering) the linear layers of a
# safetensors checkpoint are quantized to at load
QUANTIZATIONS = {"q8_0": 8, "q4_0": 2}
# the least time tensor-parallel ranks are given to start (`EngineArgs.tp_startup_timeout`)
TP_MIN_STARTUP_TIMEOUT_S = 120.0
GiB = 1 << 30
# what the engine is run for (vLLM's usage context): "server" is `pagedllm serve`
USAGE_CONTEXTS = ("offline", "server")
# the token budget per step of a server whose --max-num-batched-tokens is unset, when its
# scheduling splits prompts into chunks (vLLM's OpenAI server on CPU: 2048): a burst of prompts
# is prefilled a chunk at a time, so the first of them stream while the rest wait, where the
# offline default (the core's) takes them all in one long step
SERVER_MAX_NUM_BATCHED_TOKENS = 2048
# the KV cache's formats (vLLM's names, `kv_cache_dtype`): "auto" is the model's dtype;
# "bfloat16" a float32 model's keys and values rounded to bfloat16 (half the bytes, as
# llama.cpp's default f16 cache); "int8" and "fp8" (= "fp8_e4m3") / "fp8_e5m2" code each (token,
# kv head) row with its own scale, stored beside the row (kernels/reference.py: the formats)
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# what the model is run for (vLLM's `runner`): generating text, or pooling its hidden states
# (embeddings, scores); `convert` says how a causal LM is pooled (vLLM's `--convert`)
RUNNERS = ("generate", "pooling")
CONVERTS = ("auto", "embed", "classify")
# hf_overrides (vLLM's, `--hf-overrides`): fields of the checkpoint's config.json replaced at
# load. The ones honoured turn a causal LM into a reranker whose score is the sigmoid of two
# tokens' log-odds at the last position (Qwen3-Reranker; pagedllm/pooling/token_classifier.py);
# any other key is refused by name, never ignored
HF_OVERRIDE_KEYS = (
    "architectures",
    "classifier_from_token",
    "is_original_qwen3_reranker",
    "method",
)
# the only `method` (vLLM's name): score = logit[true token] - logit[false token], one label
TWO_WAY_SOFTMAX = "from_2_way_softmax"
# backends of the KV offload tier (kv_offloading_backend)
KV_OFFLOADING_BACKENDS = ("native", "disk")

# how the ranks of tensor parallelism are launched: spawned processes, or Ray actors
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# how data-parallel replicas are launched: one spawned process per replica, or one Ray actor
# per replica (router/ray_launcher.py)
DATA_PARALLEL_BACKENDS = ("mp", "ray")


@dataclass
class EngineArgs:
    """Every engine knob, with vLLM's names. `LLM(model, **knobs)` builds one of these."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = DEFAULTS["block_size"]
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    # the KV cache's format (KV_CACHE_DTYPES): int8 / fp8 hold 4x the tokens of float32 (less
    # each row's 4-byte scale) in the same memory
    kv_cache_dtype: str = "auto"
    # GiB for the KV cache when running on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)
    cpu_kv_cache_space: float = 1.0
    # torch intra-op threads on CPU; None: OMP_NUM_THREADS if set, else every physical core
    cpu_threads: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int | None = None
    scheduling: str = DEFAULTS["scheduling"]
    policy: str = DEFAULTS["policy"]
    preemption_mode: str | None = DEFAULTS["preemption_mode"]
    enable_prefix_caching: bool = DEFAULTS["enable_prefix_caching"]
    watermark: float = DEFAULTS["watermark"]
    long_prefill_token_threshold: int = DEFAULTS["long_prefill_token_threshold"]
    delay_factor: float = DEFAULTS["delay_factor"]
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    disable_log_stats: bool = True
    stats_log_interval: float = 5.0  # seconds between periodic stats log lines
    # speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 1} (see pagedllm.spec_decode.config)
    speculative_config: dict | None = None
    # multi-LoRA (vLLM's names): adapters per step, their largest rank, adapters kept on the host
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # tensor parallelism (vLLM's names): ranks the model is sharded over, how they are launched,
    # and how long a step may wait for a rank before the engine is declared dead (start-up has
    # its own bound: `tp_startup_timeout`)
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # mixture of experts: each rank holds 1/tensor_parallel_size of the experts whole instead of
    # a slice of every expert (attention stays sharded; no effect on a dense model)
    enable_expert_parallel: bool = False
    tp_step_timeout: float = 60.0
    # KV events (vLLM's dict: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    # "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}; see pagedllm.kv_events)
    kv_events_config: dict | None = None
    # "server" (set by `pagedllm serve`) or "offline": picks the default token budget per step
    usage_context: str = "offline"
    # data parallelism (vLLM's names): engine replicas behind one router (`pagedllm serve -dp`)
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    # KV offloading (vLLM's names): GiB of host memory for a second KV tier that keeps the
    # blocks the device cache lets go (finished requests' prefixes), and its backend
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # the disk tier's directory (kv_offloading_backend="disk"; created when missing)
    kv_offloading_path: str | None = None
    # quantize a safetensors checkpoint's linear layers at load (one of QUANTIZATIONS; CPU,
    # float32); a GGUF file's weights keep their own types
    quantization: str | None = None
    # "pooling": prefill-only requests whose result is the pooled hidden state (pagedllm.pooling)
    runner: str = "generate"
    convert: str = "auto"
    # vLLM's hf_overrides (HF_OVERRIDE_KEYS), e.g. {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    # "is_original_qwen3_reranker": true} to rerank with a causal Qwen3-Reranker checkpoint
    hf_overrides: dict | None = None

    @property
    def tp_startup_timeout(self) -> float:
        """Seconds the ranks may take to start (spawn, import, meet, load their shards) before
        the start fails: never less than `TP_MIN_STARTUP_TIMEOUT_S`, however short the step
        timeout (a loaded machine can take longer than a step just to import torch)."""
        return max(float(self.tp_step_timeout), TP_MIN_STARTUP_TIMEOUT_S)

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def __post_init__(self) -> None:
        if self.model in PACKAGED_MODELS:
            # the short name -> its file, for every part that reads it (a clear error when the
            # package is not installed)
            self.model = str(packaged_model_path(self.model))
        self.validate()

    def validate(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _one_of("usage_context", self.usage_context, USAGE_CONTEXTS)
        if self.quantization is not None:
            _one_of("quantization", self.quantization, QUANTIZATIONS)
        SpeculativeConfig.from_dict(self.speculative_config)
        KVEventsConfig.from_dict(self.kv_events_config)
        # the scheduler's and the cache's knobs: the core's rules, asked, never restated
        check_scheduler_config(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling=self.scheduling,
            policy=self.policy,
            preemption_mode=self.preemption_mode,
            watermark=self.watermark,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            delay_factor=self.delay_factor,
        )
        # the engine's own knobs
        for name in ("num_gpu_blocks", "cpu_threads"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        space = self.cpu_kv_cache_space
        if (
            isinstance(space, bool)
            or not isinstance(space, int | float)
            or not 0 < space < math.inf
        ):
            raise ValueError(f"cpu_kv_cache_space must be a number of GiB > 0, got {space!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        self._validate_runner()
        self._validate_lora()
        self._validate_parallel()
        self._validate_offloading()

    def _validate_runner(self) -> None:
        _one_of("runner", self.runner, RUNNERS)
        _one_of("convert", self.convert, CONVERTS)
        if self.convert != "auto" and self.runner != "pooling":
            raise ValueError(f"convert={self.convert!r} needs runner='pooling'")
        parallel = self.tensor_parallel_size > 1 or self.data_parallel_size > 1
        if self.runner == "pooling" and (parallel or self.speculative_config):
            raise ValueError(
                "runner='pooling' runs with tensor_parallel_size=1, data_parallel_size=1 and "
                "no speculative_config"
            )
        self._validate_hf_overrides()

    def _validate_hf_overrides(self) -> None:
        """The overrides' keys and types; whether the checkpoint can take them (a causal LM of
        the family named, tokens of its vocabulary) is the pooling engine's check."""
        overrides = self.hf_overrides
        if overrides is None:
            return
        if not isinstance(overrides, dict):
            raise ValueError(f"hf_overrides must be a dict (a JSON object), got {overrides!r}")
        for key in overrides:
            if key not in HF_OVERRIDE_KEYS:
                raise ValueError(
                    f"hf_overrides: key {key!r} is not supported (supported: "
                    f"{', '.join(HF_OVERRIDE_KEYS)})"
                )
        if not overrides:
            return
        architectures = overrides.get("architectures")
        if (
            not isinstance(architectures, list)
            or len(architectures) != 1
            or not isinstance(architectures[0], str)
            or not architectures[0].endswith("ForSequenceClassification")
        ):
            raise ValueError(
                "hf_overrides.architectures must be one *ForSequenceClassification name, e.g. "
                f"['Qwen3ForSequenceClassification'], got {architectures!r}"
            )
        tokens = overrides.get("classifier_from_token")
        if (
            not isinstance(tokens, list)
            or len(tokens) != 2
            or not all(isinstance(t, str) and t for t in tokens)
        ):
            raise ValueError(
                "hf_overrides.classifier_from_token must be two tokens [false, true], e.g. "
                f"['no', 'yes'], got {tokens!r}"
            )
        original = overrides.get("is_original_qwen3_reranker", False)
        if not isinstance(original, bool):
            raise ValueError(
                f"hf_overrides.is_original_qwen3_reranker must be a boolean, got {original!r}"
            )
        method = overrides.get("method", TWO_WAY_SOFTMAX if original else None)
        if method != TWO_WAY_SOFTMAX:
            raise ValueError(
                f"hf_overrides.method must be {TWO_WAY_SOFTMAX!r} (or give "
                f"is_original_qwen3_reranker: true), got {method!r}"
            )
        if self.runner != "pooling" or self.convert == "embed":
            raise ValueError(
                "hf_overrides (a reranker from classifier_from_token) needs runner='pooling' "
                f"and convert 'auto' or 'classify', got runner={self.runner!r}, "
                f"convert={self.convert!r}"
            )

    def _validate_offloading(self) -> None:
        size, backend = self.kv_offloading_size, self.kv_offloading_backend
        if backend is not None:
            _one_of("kv_offloading_backend", backend, KV_OFFLOADING_BACKENDS)
        if size is None:
            if backend is not None or self.kv_offloading_path is not None:
                raise ValueError(
                    f"kv_offloading_backend={backend!r} / kv_offloading_path="
                    f"{self.kv_offloading_path!r} need kv_offloading_size (GiB)"
                )
            return
        if isinstance(size, bool) or not isinstance(size, int | float) or not 0 < size < math.inf:
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {size!r}")
        if (self.resolved_kv_offloading_backend == "disk") != (self.kv_offloading_path is not None):
            raise ValueError(
                "kv_offloading_path (a directory) goes with kv_offloading_backend='disk', and "
                f"only with it; got backend {backend!r}, path {self.kv_offloading_path!r}"
            )
        if not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size needs enable_prefix_caching=True: the tier's blocks are "
                "keyed by the prefix cache's hashes"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size runs with tensor_parallel_size=1 for now")

    @property
    def resolved_kv_offloading_backend(self) -> str | None:
        """The offload tier's backend: None when off, "native" when only the size is given."""
        if self.kv_offloading_size is None:
            return None
        return self.kv_offloading_backend or "native"

    @property
    def hybrid_kv_off_reason(self) -> str | None:
        """Why the KV cache keeps every layer's blocks for the whole context even for a model
        with sliding windows (`worker/kv_layout.py`; None: it need not): the offload tier and
        KV connectors move one block table per sequence, and a draft model reads the target's
        table over the whole context."""
        if self.resolved_kv_offloading_backend is not None:
            return "the KV offload tier (kv_offloading_size) moves one block table per sequence"
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec is not None and spec.method == "draft_model":
            return (
                "a draft model (speculative_config) reads the target's table over the whole context"
            )
        return None

    def _validate_parallel(self) -> None:
        self._validate_data_parallel()
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _one_of(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            DISTRIBUTED_EXECUTOR_BACKENDS,
        )
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray, which is not installed: "
                "pip install 'pagedllm[ray]' (or use 'mp' on one machine)"
            )
        timeout = self.tp_step_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"tp_step_timeout must be a number of seconds > 0, got {timeout!r}")
        if self.tensor_parallel_size == 1:
            return
        if self.model == TINY_RANDOM_MODEL:  # built in one piece, with no shards to read
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not support "
                f"model='{TINY_RANDOM_MODEL}' (tensor parallelism needs a checkpoint folder)"
            )

    def _validate_data_parallel(self) -> None:
        """What the replicas' launchers (`serve -dp`, `LLM(data_parallel_size=N)`) would refuse
        once some replicas run, refused here, before any process starts."""
        size = self.data_parallel_size
        _positive("data_parallel_size", size)
        _one_of("data_parallel_backend", self.data_parallel_backend, DATA_PARALLEL_BACKENDS)
        if size > MAX_ROUTER_REPLICAS:
            raise ValueError(
                f"data_parallel_size (--data-parallel-size) must be at most {MAX_ROUTER_REPLICAS}"
                f" (the replicas one router indexes), got {size}"
            )
        if size == 1:
            return
        if self.data_parallel_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "data_parallel_backend='ray' (--data-parallel-backend) needs Ray, which is not "
                "installed: pip install 'pagedllm[ray]' (or use 'mp' on one machine)"
            )
        events = KVEventsConfig.from_dict(self.kv_events_config)
        if events is not None and events.publishes:
            events.for_rank(size - 1)  # the last replica's ports exist

    def _validate_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            _positive(name, getattr(self, name))
        if self.max_cpu_loras is not None:
            _positive("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
                )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @property
    def serving(self) -> bool:
        """Whether the engine runs behind a server (`usage_context`): its token budget per step
        is capped so that a burst's first prompts stream before the last are prefilled."""
        return self.usage_context == "server"

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The token budget per step: `max_num_batched_tokens`, else the scheduler's default for
        the strategy (prefill_first never splits a prompt, so its budget holds a whole one),
        capped at `SERVER_MAX_NUM_BATCHED_TOKENS` for a server whose strategy splits prompts."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        budget = default_max_num_batched_tokens(self.scheduling, max_model_len)
        if self.serving and self.scheduling != "prefill_first":
            return min(budget, SERVER_MAX_NUM_BATCHED_TOKENS)
        return budget


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
