"""Steady decode through pagedllm's scheduler next to nano-vllm's, in one process (issue 9 §8).

One step is `schedule()` + `update_from_output()` for pagedllm (fake int64 tokens, arrays not
read) and `schedule()` + `postprocess()` for nano-vllm (the same work: pick the batch, append a
slot, register full blocks in the prefix cache, append the sampled token). 1024 requests with
512-token prompts, all decoding. nano-vllm always hashes full blocks, so the like-for-like
comparison is pagedllm with prefix caching on.

Needs a checkout of nano-vllm (a mirror of its public repository) and its `xxhash` dependency:
    NANOVLLM_PATH=/path/to/nano-vllm python -m pytest benches/test_bench_vs_nanovllm.py \
        --benchmark-only --benchmark-columns=median,iqr,rounds
Without NANOVLLM_PATH the nano-vllm cases are skipped. Results: benches/RESULTS.md.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from pagedllm._core import Scheduler

from steady_state import MAX_MODEL_LEN, RUNNING, prefilled, prompts

ROUNDS = 200


def nanovllm_modules():
    """nano-vllm's scheduler and sequence modules, imported without its package __init__
    (which loads the model runner and its GPU dependencies)."""
    root = os.environ.get("NANOVLLM_PATH")
    if not root:
        pytest.skip("set NANOVLLM_PATH to a nano-vllm checkout to compare")
    pytest.importorskip("xxhash")
    package = Path(root) / "nanovllm"
    if "nanovllm" not in sys.modules:
        stub = types.ModuleType("nanovllm")
        stub.__path__ = [str(package)]
        sys.modules["nanovllm"] = stub
    scheduler = importlib.import_module("nanovllm.engine.scheduler")
    sequence = importlib.import_module("nanovllm.engine.sequence")
    params = importlib.import_module("nanovllm.sampling_params")
    return scheduler, sequence, params


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("caching", [True, False])
def test_pagedllm_steady_decode(benchmark, block_size, caching):
    s = prefilled(Scheduler, block_size, caching)
    tokens = np.full(RUNNING, 7, dtype=np.int64)

    def step():
        s.update_from_output(s.schedule(), tokens)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    assert s.num_running() == RUNNING and s.get_stats()["num_preemptions"] == 0


@pytest.mark.parametrize("block_size", [16, 256])
def test_nanovllm_steady_decode(benchmark, block_size):
    scheduler_mod, sequence_mod, params_mod = nanovllm_modules()
    sequence_mod.Sequence.block_size = block_size  # nano-vllm keeps it on the class
    config = types.SimpleNamespace(
        max_num_seqs=RUNNING,
        max_num_batched_tokens=16384,
        eos=-1,
        kvcache_block_size=block_size,
        num_kvcache_blocks=RUNNING * (MAX_MODEL_LEN // block_size + 1),
    )
    s = scheduler_mod.Scheduler(config)
    sp = params_mod.SamplingParams(temperature=1.0, max_tokens=1024, ignore_eos=True)
    for p in prompts():
        s.add(sequence_mod.Sequence(p, sp))
    while True:  # prefill everything first
        seqs, is_prefill = s.schedule()
        s.postprocess(seqs, [7] * len(seqs), is_prefill)
        if not is_prefill and len(seqs) == RUNNING:
            break

    def step():
        seqs, is_prefill = s.schedule()
        s.postprocess(seqs, [7] * len(seqs), is_prefill)

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    assert len(s.running) == RUNNING
