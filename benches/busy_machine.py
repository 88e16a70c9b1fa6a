"""`pagedllm bench` on a quiet machine and with a CPU hog on one core, alternated.

Each configuration (a name and extra environment / bench flags) runs once quiet and once with a
hog pinned to the last CPU this process may use (`taskset -c N python -c 'while True: pass'`,
started before and killed after that run), round after round; each run is a fresh
`pagedllm bench --json` process. Prints one JSON line per run and a table of medians.

    python benches/busy_machine.py --model /tmp/llama56m --rounds 3 \
        --config default= --config threads1=--cpu-threads=1 --config passive=OMP_WAIT_POLICY=PASSIVE
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager


def parse_config(text: str) -> tuple[str, dict, list[str]]:
    """name=ITEM,ITEM: an ITEM starting with -- is a bench flag, KEY=VALUE an env variable."""
    name, _, rest = text.partition("=")
    env, flags = {}, []
    for item in filter(None, rest.split(",")):
        if item.startswith("--"):
            flags.append(item)
        else:
            key, _, value = item.partition("=")
            env[key] = value
    return name, env, flags


@contextmanager
def hog(enabled: bool):
    if not enabled:
        yield None
        return
    cpu = max(os.sched_getaffinity(0))
    cmd = [sys.executable, "-c", "while True: pass"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(cmd)
    try:
        time.sleep(0.5)
        yield cpu
    finally:
        proc.kill()
        proc.wait()


def run(args, env_extra: dict, flags: list[str], busy: bool) -> dict:
    cmd = [
        sys.executable, "-m", "pagedllm.cli", "bench", "--model", args.model,
        "--num-prompts", str(args.num_prompts), "--min-input-len", str(args.min_input_len),
        "--input-len", str(args.input_len), "--min-output-len", str(args.min_output_len),
        "--output-len", str(args.output_len), "--max-model-len", str(args.max_model_len),
        "--device", "cpu", "--json", *flags,
    ]  # fmt: skip
    env = {**os.environ, **env_extra}
    with hog(busy):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--config", action="append", default=[], help="name=ITEM,ITEM (see doc)")
    p.add_argument("--no-quiet", action="store_true", help="only the busy runs")
    args = p.parse_args()
    configs = [parse_config(c) for c in args.config or ["default="]]
    figures: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, env, flags in configs:
            for busy in (False, True) if not args.no_quiet else (True,):
                r = run(args, env, flags, busy)
                state = "busy" if busy else "quiet"
                rate = r["output_tokens_per_s"]
                figures.setdefault((name, state), []).append(rate)
                line = {"config": name, "state": state, "output_tok_s": round(rate, 1),
                        "mean_step_ms": r["mean_step_ms"], "load": os.getloadavg()[0]}  # fmt: skip
                print(json.dumps(line), flush=True)
    print("| config | quiet tok/s (runs) | busy tok/s (runs) | busy / quiet (medians) |")
    print("| --- | --- | --- | ---: |")
    for name, _, _ in configs:
        q, b = figures.get((name, "quiet"), []), figures.get((name, "busy"), [])
        ratio = statistics.median(b) / statistics.median(q) if q and b else float("nan")
        fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
        print(f"| {name} | {fmt(q)} | {fmt(b)} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
