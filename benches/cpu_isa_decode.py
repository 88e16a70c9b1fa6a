"""A model's decode at two CPU ISA levels (`PAGEDLLM_CPU_ISA`, which is decided once per
process, so one process per level), alternated for `--rounds` rounds: decode tok/s of
`--tokens` greedy tokens after a 16-token prompt, by wall time and by the process's CPU time
(on a busy machine the CPU time counts only this process's work), medians and the median of the
rounds' ratios; and whether the two levels' greedy tokens are identical.

    python benches/cpu_isa_decode.py /work/models/kvq-smollm2-f32 --levels avx2 avx512 \\
        [--rounds 3] [--tokens 128] [--threads 1] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(args) -> None:
    from pagedllm import LLM, SamplingParams, _core

    llm = LLM(args.model, cpu_threads=args.threads, dtype=args.dtype)
    prompt = [{"prompt_token_ids": list(range(100, 116))}]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    wall, cpu = time.perf_counter(), time.process_time()
    out = llm.generate(prompt, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = list(out[0].outputs[0].token_ids)
    level = _core.cpu_isa()[0]
    print(json.dumps({"isa": level, "wall": wall, "cpu": cpu, "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--levels", nargs=2, default=["avx2", "avx512"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="the model's (EngineArgs.dtype)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    first, second = args.levels
    runs: dict[str, list[dict]] = {first: [], second: []}
    for r in range(args.rounds):
        for level in (first, second) if r % 2 == 0 else (second, first):
            cmd = [sys.executable, __file__, args.model, "--child", "--tokens", str(args.tokens)]
            cmd += ["--threads", str(args.threads), "--dtype", args.dtype]
            env = {**os.environ, "PAGEDLLM_CPU_ISA": level}
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            if got["isa"] != level:
                raise SystemExit(f"asked for {level}, the process ran at {got['isa']}")
            runs[level].append(got)
    print(
        f"{args.model} ({args.dtype}): {args.tokens} tokens, {args.threads} thread(s), "
        f"{args.rounds} rounds"
    )
    for clock in ("wall", "cpu"):
        rate = {lv: [args.tokens / run[clock] for run in runs[lv]] for lv in runs}
        ratio = statistics.median(b / a for a, b in zip(rate[first], rate[second]))
        print(
            f"{clock}: {first} {statistics.median(rate[first]):.1f} tok/s, "
            f"{second} {statistics.median(rate[second]):.1f} tok/s, "
            f"{second} / {first} {ratio:.3f}x (median of rounds)"
        )
    same = all(run["tokens"] == runs[first][0]["tokens"] for lv in runs for run in runs[lv])
    print(f"greedy tokens identical across levels and rounds: {same}")


if __name__ == "__main__":
    main()
