"""`pagedllm bench`: offline throughput on random prompts (`cli/bench.py`), and `bench serve`:
concurrent streaming clients against a running server (`cli/bench_serve.py`), alone or side by
side with vLLM's (`cli/serve_compare.py`)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from pagedllm.cli.flags import (
    EPILOG,
    POSITIVE,
    check_device,
    common_flags,
    engine_flags,
    engine_kwargs,
)
from pagedllm.config import DTYPE_NAMES


def add_parsers(sub) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `bench` subcommand's parser and its `bench serve` mode's."""
    bench = sub.add_parser("bench", help="offline throughput on random prompts", epilog=EPILOG)
    bench.add_argument("--num-prompts", type=POSITIVE, default=64, help="random prompts")
    bench.add_argument("--input-len", type=POSITIVE, default=128, help="prompt tokens")
    bench.add_argument(
        "--output-len",
        type=POSITIVE,
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
        type=POSITIVE,
        default=None,
        help="draw each prompt's length uniformly from [this, --input-len] (default: fixed)",
    )
    bench.add_argument(
        "--min-output-len",
        type=POSITIVE,
        default=None,
        help="draw each output length uniformly from [this, --output-len] (default: fixed)",
    )
    bench.add_argument(
        "--rounds", type=POSITIVE, default=1, help="timed runs of the workload (median reported)"
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
    common_flags(bench)
    engine_flags(bench)
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
    bench_serve.add_argument("--num-prompts", type=POSITIVE, default=64, help="requests sent")
    bench_serve.add_argument(
        "--input-len", type=POSITIVE, default=128, help="prompt length in characters"
    )
    bench_serve.add_argument("--output-len", type=POSITIVE, default=64, help="generated tokens")
    bench_serve.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    bench_serve.add_argument(
        "--max-concurrency",
        type=POSITIVE,
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
        "--rounds", type=POSITIVE, default=2, help="with --compare-vllm-python: rounds"
    )
    bench_serve.add_argument(
        "--max-model-len",
        type=POSITIVE,
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
    common_flags(bench_serve)
    return bench, bench_serve


def run(args: argparse.Namespace) -> int:
    from pagedllm.cli.bench import check_lengths, run_bench

    if args.max_model_len is not None:  # refuse before loading the model when we already know
        check_lengths(args.input_len, args.output_len, args.max_model_len)
    check_device(args.device)
    result = run_bench(
        engine_kwargs=engine_kwargs(args),
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


def run_serve(args: argparse.Namespace) -> int:
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
