"""The `pagedllm` command: `generate` and `bench`."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from pagedllm.config import DEFAULT_MODEL, POLICIES, SCHEDULING_STRATEGIES


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint folder, or the built-in pagedllm/tiny-random (default)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--scheduling", default="unified", choices=SCHEDULING_STRATEGIES)
    g.add_argument("--policy", default="fcfs", choices=POLICIES)
    g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                seed=args.seed, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, scheduling=args.scheduling,
                policy=args.policy, preemption_mode=args.preemption_mode,
                enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager)


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("pagedllm generate: give prompts as arguments or with --file", file=sys.stderr)
        return 2
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(**_engine_kwargs(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    generated = 0
    for out in outputs:
        for completion in out.outputs:
            generated += len(completion.token_ids)
            label = f"[{out.request_id}.{completion.index}]" if args.n > 1 else f"[{out.request_id}]"
            print(f"{label} {out.prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    stats = llm.engine.get_stats()
    print(f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in "
          f"{elapsed:.2f} s: {generated / elapsed:.1f} generated tok/s, "
          f"{(prompt_tokens + generated) / elapsed:.1f} total tok/s; "
          f"prefix hit rate {100 * stats['prefix_cache_hit_rate']:.1f}%, "
          f"preemptions {stats['num_preemptions']}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from pagedllm.bench import run_bench

    result = run_bench(engine_kwargs=_engine_kwargs(args), num_prompts=args.num_prompts,
                       input_len=args.input_len, output_len=args.output_len,
                       compare_transformers=args.compare_transformers, seed=args.seed)
    print(json.dumps(result, indent=2) if args.json else result["summary"])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    _engine_flags(gen)
    _sampling_flags(gen)
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="offline throughput on random prompts")
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--compare-transformers", action="store_true",
                       help="also run transformers generate on the same workload")
    bench.add_argument("--json", action="store_true", help="print the full result as JSON")
    _engine_flags(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
