"""`pagedllm run-batch`: a file of requests in OpenAI's batch format answered by the server's own
routes, in-process (vLLM's `run-batch`), into a file of results, one line per request in order."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from pagedllm.cli.flags import (
    EPILOG,
    add_pooling_flags,
    check_device,
    common_flags,
    engine_flags,
    engine_kwargs,
    pooling_engine_kwargs,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """The `run-batch` subcommand's parser."""
    parser = sub.add_parser(
        "run-batch",
        help="answer a JSONL file of OpenAI batch requests into a JSONL file of results",
        epilog=EPILOG,
    )
    g = parser.add_argument_group("batch")
    g.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="JSONL, one request a line: {custom_id, method: POST, url: /v1/chat/completions | "
        "/v1/completions | /v1/embeddings, body} (a local path; '-' reads stdin)",
    )
    g.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="JSONL results, one line per request in input order (a local path; '-' is stdout)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the model name bodies give (default: --model)"
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="Jinja2 chat template file (default: the checkpoint's, else a built-in one)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_pooling_flags(parser)
    common_flags(parser)
    engine_flags(parser)
    return parser


def _local(path: str, flag: str) -> str:
    """`path`, refused where it is a URL (vLLM reads those; here, download it first)."""
    if "://" in path:
        raise ValueError(f"{flag} {path!r}: a URL; run-batch reads and writes local files only")
    return path


def _read_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input-file {path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def run(args: argparse.Namespace) -> int:
    input_path = _local(args.input_file, "--input-file")
    output_path = _local(args.output_file, "--output-file")
    lines = _read_lines(input_path)  # before a model is loaded for nothing
    if output_path != "-":
        folder = os.path.dirname(os.path.abspath(output_path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"--output-file {output_path!r}: no folder {folder!r}")
    from pagedllm.chat.template import load_chat_template
    from pagedllm.entrypoints.api_server import ServerConfig, build_server_app
    from pagedllm.models.gguf import served_model_name

    check_device(args.device)
    config = ServerConfig(
        served_model_name=args.served_model_name or served_model_name(args.model),
        chat_template=load_chat_template(args.chat_template),
    )
    # usage_context stays "offline": a batch wants throughput, not a server's short steps
    app = build_server_app(engine_kwargs(args) | pooling_engine_kwargs(args), config)
    start = time.perf_counter()
    counts = asyncio.run(_answer(app, lines, output_path, progress=not args.no_progress))
    elapsed = time.perf_counter() - start
    print(
        f"run-batch: {counts.completed} completed, {counts.failed} failed, "
        f"{counts.total_tokens} tokens in {elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0


async def _answer(app, lines: list[str], output_path: str, progress: bool):
    import json

    from tqdm.auto import tqdm

    from pagedllm.entrypoints.batch_runner import BatchCounts, in_process_client, run_lines

    counts = BatchCounts()
    total = sum(1 for line in lines if line.strip())
    bar = tqdm(total=total, desc="run-batch", unit="req", disable=not progress, file=sys.stderr)
    out = sys.stdout if output_path == "-" else open(output_path, "w", encoding="utf-8")  # noqa: SIM115
    try:
        async with in_process_client(app) as client:
            async for result in run_lines(client, lines, lambda _: bar.update(1)):
                counts.add(result)
                out.write(json.dumps(result) + "\n")
    finally:
        bar.close()
        if out is not sys.stdout:
            out.close()
    return counts
