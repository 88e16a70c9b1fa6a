"""Microbenchmarks of the scheduler through the Python bindings.

Each step is one `schedule()` plus one `update_from_output` with fake sampled tokens (an int64
array); the step arrays are not read (they are built lazily). Results: benches/RESULTS.md.

Run: python -m pytest benches/test_bench_scheduler.py --benchmark-only
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads spin on small machines

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pagedllm._core import Scheduler  # noqa: E402

VOCAB = 50_000


def drive(s: Scheduler, counts: dict) -> None:
    """Steps until every request is done, counting steps and scheduled sequences."""
    steps = seqs = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
        steps += 1
        seqs += out.num_seqs
    counts.update(steps=steps, scheduled_seqs=seqs)


def whole_run(benchmark, make, rounds: int = 3) -> dict:
    """Times `drive` over a fresh scheduler from `make()` (building it is not timed)."""
    counts: dict = {}
    benchmark.pedantic(
        lambda s: drive(s, counts), setup=lambda: ((make(),), {}), rounds=rounds, iterations=1
    )
    benchmark.extra_info.update(counts)
    return counts


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("running", [256, 1024, 4096])
def test_steady_decode(benchmark, running, block_size, caching):
    rounds = 200
    s = Scheduler(
        block_size=block_size,
        max_num_seqs=running,
        max_model_len=2048,
        max_num_batched_tokens=max(8192, running),
        num_gpu_blocks=running * (2048 // block_size + 1),
        enable_prefix_caching=caching,
    )  # room for max_model_len
    rng = np.random.default_rng(0)
    for i in range(running):
        s.add_request(f"r{i}", rng.integers(0, VOCAB, 512), max_tokens=1024, ignore_eos=True)
    while True:  # prefill everything first
        out = s.schedule()
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
        if out.is_decode_only and out.num_seqs == running:
            break
    tokens = np.full(running, 7, dtype=np.int64)

    def step():
        s.update_from_output(s.schedule(), tokens)

    benchmark.pedantic(step, rounds=rounds, warmup_rounds=10, iterations=1)
    benchmark.extra_info["seqs_per_step"] = running
    assert s.num_running() == running and s.get_stats()["num_preemptions"] == 0


@pytest.mark.parametrize("block_size", [16, 256])
def test_admission_burst(benchmark, block_size):
    """1024 prompts (lengths uniform in 128..1024) admitted under a 16384-token budget and 512
    sequences; each finishes with its first token, so the run is the whole admission."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n) for n in rng.integers(128, 1025, 1024)]

    def make():
        s = Scheduler(
            block_size=block_size,
            max_num_seqs=512,
            max_num_batched_tokens=16384,
            num_gpu_blocks=512 * 1024 // block_size + 64,
        )
        for i, p in enumerate(prompts):
            s.add_request(f"r{i}", p, max_tokens=1)
        return s

    whole_run(benchmark, make)


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefix_heavy_admission(benchmark, block_size):
    """256 prompts = one shared 2048-token prefix + 128 unique tokens each."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, 2048)
    prompts = [np.concatenate([shared, rng.integers(0, VOCAB, 128)]) for _ in range(256)]

    def make():
        s = Scheduler(
            block_size=block_size,
            max_num_seqs=256,
            max_num_batched_tokens=16384,
            max_model_len=4096,
            num_gpu_blocks=256 * 2304 // block_size + 64,
        )
        for i, p in enumerate(prompts):
            s.add_request(f"r{i}", p, max_tokens=1)
        return s

    counts = whole_run(benchmark, make)
    assert counts["steps"] <= 4


@pytest.mark.parametrize("preemption_mode", [None, "recompute", "swap"])
def test_overloaded_pool(benchmark, preemption_mode):
    """KV for about 60% of the peak demand: 128 requests (every fourth with n=2), prompt 256,
    128 tokens each; preemptions happen all along."""
    bs = 16
    ns = [2 if i % 4 == 0 else 1 for i in range(128)]
    peak = sum(n * (256 + 128) // bs for n in ns)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, 256) for _ in ns]
    stats: dict = {}

    def make():
        s = Scheduler(
            block_size=bs,
            num_gpu_blocks=int(0.6 * peak),
            num_cpu_blocks=int(0.6 * peak),
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            preemption_mode=preemption_mode,
        )
        stats["s"] = s
        for i, (p, n) in enumerate(zip(prompts, ns)):
            s.add_request(f"r{i}", p, n=n, max_tokens=128, ignore_eos=True)
        return s

    whole_run(benchmark, make)
    st = stats["s"].get_stats()
    benchmark.extra_info.update(
        preemptions_recompute=st["num_preemptions_recompute"],
        preemptions_swap=st["num_preemptions_swap"],
    )
    assert st["num_preemptions"] > 0


@pytest.mark.parametrize("scheduling", ["prefill_first", "chunked_prefill", "unified"])
def test_strategy(benchmark, scheduling):
    """256 requests, prompts 64..512, 16..128 tokens each, budget 4096, ample cache."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n) for n in rng.integers(64, 513, 256)]
    max_tokens = rng.integers(16, 129, 256)

    def make():
        s = Scheduler(
            block_size=16,
            num_gpu_blocks=256 * 640 // 16,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            scheduling=scheduling,
        )
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            s.add_request(f"r{i}", p, max_tokens=int(m), ignore_eos=True)
        return s

    whole_run(benchmark, make)
