"""`pagedllm generate`: text for prompts given as arguments or in a file, through `LLM`."""

from __future__ import annotations

import argparse
import sys
import time

from pagedllm.cli.flags import (
    EPILOG,
    check_device,
    common_flags,
    engine_flags,
    engine_kwargs,
    sampling_flags,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """The `generate` subcommand's parser."""
    gen = sub.add_parser("generate", help="generate text for prompts", epilog=EPILOG)
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    common_flags(gen)
    engine_flags(gen)
    sampling_flags(gen)
    return gen


def run(args: argparse.Namespace) -> int:
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
    check_device(args.device)
    llm = LLM(**engine_kwargs(args))
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
