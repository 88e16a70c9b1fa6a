"""`pagedllm serve`: the OpenAI-compatible HTTP server over one engine, or with
--data-parallel-size N, N replicas (processes or Ray actors) behind the router."""

from __future__ import annotations

import argparse
import logging
import os

from pagedllm.cli.commands import router
from pagedllm.cli.flags import (
    EPILOG,
    POSITIVE,
    add_pooling_flags,
    check_device,
    common_flags,
    engine_flags,
    engine_kwargs,
    listen_flags,
    log_level_flag,
    number,
    pooling_engine_kwargs,
    routing_flags,
)
from pagedllm.config import EngineArgs


def add_parser(sub) -> argparse.ArgumentParser:
    """The `serve` subcommand's parser."""
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (SIGINT/SIGTERM stop it)", epilog=EPILOG
    )
    g = serve.add_argument_group("server")
    listen_flags(g)
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
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; "
        "also turned on by PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
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
        type=POSITIVE,
        default=None,
        help="429 beyond this many requests waiting, not yet generating (default: no limit)",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=POSITIVE,
        default=None,
        help="429 beyond this many prompt tokens waiting (default: no limit)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=POSITIVE,
        default=None,
        help="413 for a request body over this many bytes (default: 4 MiB)",
    )
    g.add_argument(
        "--max-failed-steps",
        type=POSITIVE,
        default=None,
        help="failed engine steps in a row (none succeeding) after which the server exits with "
        "status 1, for a supervisor to restart it (default: 30, ~25 s of failing; fewer "
        "are retried with back-off, /health failing meanwhile)",
    )
    g.add_argument(
        "--shutdown-grace",
        type=number(0.0),
        default=5.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are "
        "aborted",
    )
    log_level_flag(g, help="the server's log level (uvicorn's and pagedllm's)")
    add_pooling_flags(serve)
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
    common_flags(serve)
    engine_flags(serve)
    routing_flags(serve)
    return serve


def _lora_module(text: str) -> tuple[str, str]:
    """`name=path` of --lora-modules."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def run(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        return _serve_data_parallel(args)
    from pagedllm.chat.template import load_chat_template
    from pagedllm.chat.tools import ChatOptions, structured_outputs_config
    from pagedllm.entrypoints.api_server import ServerConfig, build_server_app, run_server
    from pagedllm.models.gguf import served_model_name

    check_device(args.device)
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
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        chat_options=chat_options,
        # unset: ServerConfig's defaults (kept there, not imported here: fastapi is slow to load)
        **{
            name: getattr(args, name)
            for name in ("max_request_body_bytes", "max_failed_steps")
            if getattr(args, name) is not None
        },
    )
    kwargs = _engine_kwargs(args) | {"usage_context": "server"}
    if config.lora_modules:
        kwargs["enable_lora"] = True  # serving adapters implies --enable-lora
    # pagedllm's own log lines (start-up, engine faults) next to uvicorn's, at --log-level
    logger = logging.getLogger("pagedllm")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-8s %(name)s: %(message)s"))
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(args.log_level.upper())
    try:
        app = build_server_app(kwargs, config)
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


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine's keywords: the shared engine flags and serve's pooling flags."""
    return engine_kwargs(args) | pooling_engine_kwargs(args)


def _serve_data_parallel(args: argparse.Namespace) -> int:
    """`serve -dp N`: N replicas (processes) behind the router, on --host/--port."""
    from pagedllm.router.launcher import check_listen_address

    # what the start would refuse once replicas run, refused before any process starts: the
    # engine's knobs (EngineArgs: the replicas, their backend, their event ports too), the
    # device, the router's address
    EngineArgs.from_kwargs(**_engine_kwargs(args))
    check_device(args.device)
    check_listen_address(args.host, args.port)
    if args.data_parallel_backend == "ray":
        from pagedllm.router.ray_launcher import run_data_parallel_ray as run_data_parallel
    else:
        from pagedllm.router.launcher import run_data_parallel
    return run_data_parallel(
        args, run, lambda urls: router.run(argparse.Namespace(**{**vars(args), "replica": urls}))
    )


def loaded_summary(engine) -> list[str]:
    """What an engine loaded, in two lines (`pagedllm serve` logs them at start-up)."""
    args, cache = engine.args, engine.cache_engine
    dtype = str(engine.dtype).removeprefix("torch.")
    threads, tp = engine.runner.cpu_threads, args.tensor_parallel_size
    isa = engine.runner.cpu_isa
    loaded = (
        f"loaded {args.model} on {engine.device} in {dtype}: max_model_len {engine.max_model_len}, "
        f"KV cache {cache.num_gpu_blocks} blocks on the device + {cache.num_cpu_blocks} swap "
        f"blocks on the host, {args.block_size} tokens per block"
        + (f", CPU kernels {isa[0]} ({' '.join(isa[1]) or 'no flags'})" if isa else "")
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
