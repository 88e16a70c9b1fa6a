"""Where a TP=2 step's time goes on rank 0: the collectives per step (count, bytes, time) against
the whole forward, in steady decode and in prefill.

    PYTHONPATH=python python benches/tp_step_profile.py --model /tmp/<dir>/llama56m
"""

from __future__ import annotations

import argparse
import collections
import time

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import layers, parallel_state

_depth = [0]  # a gather made of an all-reduce counts once, as the gather


def _timed(table: dict, name: str, fn):
    def wrapped(x):
        if _depth[0]:
            return fn(x)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            out = fn(x)
        finally:
            _depth[0] -= 1
        entry = table[(name, x.numel() * x.element_size())]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        return out

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    table: dict = collections.defaultdict(lambda: [0, 0.0])
    # the layers call these through the module: wrap them there (rank 0 only; ranks run alike)
    layers.parallel_state.all_reduce = _timed(table, "all_reduce", parallel_state.all_reduce)
    layers.parallel_state.gather_to_first = _timed(
        table, "gather_to_first", parallel_state.gather_to_first
    )
    llm = LLM(
        args.model, tensor_parallel_size=2, cpu_threads=1, device="cpu", skip_tokenizer_init=True
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(64)]}
        for i in range(args.num_seqs)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    table.clear()
    from pagedllm.engine import StepTimings

    llm.engine.timings = StepTimings()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    timings = llm.engine.timings
    steps = timings.steps
    print(f"{steps} steps, {elapsed:.2f} s, forward {1e3 * timings.forward / steps:.2f} ms/step")
    print("| collective | bytes per rank | calls per step | ms per step |")
    print("| --- | ---: | ---: | ---: |")
    total = 0.0
    for (name, size), (calls, spent) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        total += spent
        if spent / steps > 1e-5:
            print(f"| {name} | {size} | {calls / steps:.2f} | {1e3 * spent / steps:.3f} |")
    print(f"collectives: {1e3 * total / steps:.2f} ms of {1e3 * timings.forward / steps:.2f} ms")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
