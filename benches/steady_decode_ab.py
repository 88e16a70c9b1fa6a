"""Steady decode of two or more scheduler builds, alternated, one fresh process per run.

The step's time moves by ~15 % with where a process's earlier allocations left the heap, and a
shared machine has slow and fast minutes; so a comparison of builds runs each in its own fresh
process, alternated run by run, and reports each build's sorted per-run medians. A build is an
extension file (`_core.abi3.so`, e.g. copied from `python/pagedllm/` after `maturin develop`
at each commit); it is loaded on its own, without the rest of the package.

One run: the setup of `steady_state.py` (1024 requests with 512-token prompts, prefilled),
then `schedule()` + `update_from_output()` timed step by step for 200 steps after 10 warm-up
steps; the run's median is printed.

    python benches/steady_decode_ab.py /tmp/old.so /tmp/new.so --caching on --runs 8
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sys
import time

import numpy as np

from steady_state import RUNNING, prefilled


def load_core(path: str):
    """The `_core` extension at `path`, imported under its own name only."""
    loader = importlib.machinery.ExtensionFileLoader("_core", path)
    spec = importlib.util.spec_from_file_location("_core", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def one_run(path: str, caching: bool, block_size: int, steps: int) -> float:
    """Median microseconds per steady decode step of the build at `path`."""
    s = prefilled(load_core(path).Scheduler, block_size, caching)
    tokens = np.full(RUNNING, 7, dtype=np.int64)
    times = []
    for _ in range(10 + steps):
        start = time.perf_counter()
        s.update_from_output(s.schedule(), tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="paths of _core extension files")
    parser.add_argument("--caching", choices=["on", "off"], default="on")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one run of one build
        print(one_run(args.builds[0], args.caching == "on", args.block_size, args.steps))
        return
    medians: dict[str, list[float]] = {b: [] for b in args.builds}
    for _ in range(args.runs):
        for build in args.builds:
            child = [sys.executable, __file__, build, "--one", "--caching", args.caching]
            child += ["--block-size", str(args.block_size), "--steps", str(args.steps)]
            medians[build].append(float(subprocess.check_output(child, text=True)))
    for build, values in medians.items():
        runs = " ".join(f"{v:.1f}" for v in sorted(values))
        print(f"{build}: median {statistics.median(values):.1f} us  (runs: {runs})")


if __name__ == "__main__":
    main()
