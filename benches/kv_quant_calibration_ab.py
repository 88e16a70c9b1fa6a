"""Decode step time of a quantized KV cache with the start-up key calibration (the per-layer
key transform `(k - c) * s`, `q / s`: `worker/kv_calibration.py`) against without it
(`PAGEDLLM_KV_CALIBRATION=0`): two engines in one process, `--batch` sequences each at
`--context` tokens, timed `--steps` decode steps at a time, alternated `--rounds` times.
Prints each round's ms per step and the median ratio (calibrated / not).

    python benches/kv_quant_calibration_ab.py [--model smollm2] [--kv-cache-dtype int8] \
        [--context 1024] [--batch 1] [--steps 16] [--rounds 7] [--calibration 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from pagedllm import LLM, SamplingParams


def engine(args, calibration: str) -> LLM:
    os.environ["PAGEDLLM_KV_CALIBRATION"] = calibration
    llm = LLM(
        args.model,
        dtype="float32",
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.context + 1024,
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(0)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        ids = rng.integers(0, vocab, size=args.context).tolist()
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    for _ in range(args.batch * (args.context // 256 + 2) + 4):  # prefill, first decodes
        llm.llm_engine.step()
    return llm


def time_steps(llm: LLM, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        llm.llm_engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kv-cache-dtype", default="int8")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calibration", default="256")
    args = p.parse_args()
    on, off = engine(args, args.calibration), engine(args, "0")
    assert on.llm_engine.cache_engine.key_calibration is not None
    assert off.llm_engine.cache_engine.key_calibration is None
    ratios = []
    for r in range(args.rounds):
        if r % 2:  # which engine runs first alternates
            off_ms = time_steps(off, args.steps)
            on_ms = time_steps(on, args.steps)
        else:
            on_ms = time_steps(on, args.steps)
            off_ms = time_steps(off, args.steps)
        ratios.append(on_ms / off_ms)
        print(json.dumps({"round": r, "ms_calibrated": on_ms, "ms_off": off_ms}), flush=True)
    print(json.dumps({"median_ratio_calibrated_over_off": round(statistics.median(ratios), 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
