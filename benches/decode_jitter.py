"""Inter-token latency at steady decode: the time of every engine step while a fixed batch of
requests decodes (no prefill in the window), its p50 / p99 / max, and which steps ran a
garbage collection of Python's oldest generation.

Each step's wall time is one inter-token interval of every request in the batch. Thread CPU
time is reported beside it: a step made long by another process holding the core shows in wall
time only, one made long by work of our own (a collection) in both.

    python benches/decode_jitter.py --model /tmp/llama56m --batch 8 --steps 600 [--gc default]
        [--dtype bfloat16]

`--gc default` undoes the engine's start-up heap handling (unfreezes the heap and restores
Python's default thresholds) after the engine is built, for a before/after in the same minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="pagedllm/tiny-random")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--gc", choices=["engine", "default"], default="engine")
    # the engine's dtype argument ("auto": the checkpoint's, float32 on the CPU)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()

    from pagedllm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            max_model_len=args.prompt_len + args.steps + args.warmup_steps + 8,
            cpu_threads=args.cpu_threads,
            disable_log_stats=True,
        )
    )
    if args.gc == "default":
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(
        temperature=0.0, max_tokens=args.steps + args.warmup_steps + 2, ignore_eos=True
    )
    for i in range(args.batch):
        ids = [(7 * i + 13 * j) % vocab for j in range(args.prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    while not all(engine.requests[r].seqs[0].token_ids for r in engine.requests):
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    collections: list[int] = []
    step_no = [0]
    # per generation: [count, total ms, max ms]
    gc_ms = {g: [0, 0.0, 0.0] for g in range(3)}
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            if info["generation"] == 2:
                collections.append(step_no[0])
            return
        ms = 1e3 * (time.perf_counter() - started[0])
        entry = gc_ms[info["generation"]]
        entry[0] += 1
        entry[1] += ms
        entry[2] = max(entry[2], ms)

    gc.callbacks.append(on_gc)
    wall, cpu = [], []
    try:
        for i in range(args.steps):
            step_no[0] = i
            w0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            wall.append(1e3 * (time.perf_counter() - w0))
            cpu.append(1e3 * (time.thread_time() - c0))
    finally:
        gc.callbacks.remove(on_gc)
    spikes = [i for i, ms in enumerate(cpu) if ms > 1.5 * statistics.median(cpu)]
    result = {
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "gc": args.gc,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": engine.runner.cpu_threads,
        "wall_ms": _summary(wall),
        "cpu_ms": _summary(cpu),
        "gen2_collections_at_steps": collections,
        "collections": {
            f"gen{g}": {"count": c, "total_ms": round(t, 2), "max_ms": round(m, 3)}
            for g, (c, t, m) in gc_ms.items()
        },
        "cpu_spike_steps": spikes[:40],
        "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
    }
    print(json.dumps(result))
    return 0


def _summary(values: list[float]) -> dict:
    p50 = statistics.median(values)
    p99 = percentile(values, 99)
    return {
        "p50": round(p50, 3),
        "p90": round(percentile(values, 90), 3),
        "p99": round(p99, 3),
        "max": round(max(values), 3),
        "p99_over_p50": round(p99 / p50, 2),
    }


if __name__ == "__main__":
    sys.exit(main())
