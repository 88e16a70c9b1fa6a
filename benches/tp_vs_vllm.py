"""End to end, side by side in one run: pagedllm TP=2 (one thread per rank), pagedllm TP=1 (two
threads) and vLLM's CPU backend at -tp 2 (driven in its own interpreter), rounds alternated,
greedy outputs compared with TP=1's.

    PYTHONPATH=python python benches/tp_vs_vllm.py --model /tmp/<dir>/llama56m \\
        --vllm-python /work/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cli.bench import bench_workload
from pagedllm.cli.vllm_compare import VllmProcess, greedy_agreement


def _timed(llm: LLM, threads: int, inputs, params) -> tuple[float, list[list[int]], float]:
    """(output tok/s, tokens per prompt, mean forward ms per step) of one generate."""
    from pagedllm.engine import StepTimings

    torch.set_num_threads(threads)  # process-wide: both engines' rank 0 live in this process
    llm.engine.timings = StepTimings()
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    timings = llm.engine.timings
    forward_ms = 1e3 * timings.forward / max(1, timings.steps)
    return sum(map(len, tokens)) / elapsed, tokens, forward_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    common = dict(device="cpu", max_model_len=args.max_model_len, skip_tokenizer_init=True)
    threads = {"pagedllm TP=2 (1 thread/rank)": 1, "pagedllm TP=1 (2 threads)": 2}
    engines = {
        "pagedllm TP=2 (1 thread/rank)": LLM(
            args.model, tensor_parallel_size=2, cpu_threads=1, **common
        ),
        "pagedllm TP=1 (2 threads)": LLM(args.model, cpu_threads=2, **common),
    }
    vocab = engines["pagedllm TP=1 (2 threads)"].engine.model_config.vocab_size
    prompts, max_tokens = bench_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        vocab,
        0,
        args.min_input_len,
        args.min_output_len,
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    for llm in engines.values():
        llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up
    vllm = VllmProcess(
        args.vllm_python,
        model=str(Path(args.model)),
        dtype="float32",
        max_model_len=args.max_model_len,
        seed=0,
        prompts=prompts,
        max_tokens=max_tokens,
        kv_cache_space_gib=1,
        tensor_parallel_size=2,
    )
    rates: dict[str, list[float]] = {name: [] for name in [*engines, "vLLM TP=2"]}
    forward: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for r in range(args.rounds):
            for name, llm in engines.items():
                rate, outputs[name], fwd = _timed(llm, threads[name], inputs, params)
                rates[name].append(rate)
                forward[name].append(fwd)
            run = vllm.run()
            rates["vLLM TP=2"].append(run["generated_tokens"] / run["elapsed_s"])
            outputs["vLLM TP=2"] = run["outputs"]
            print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()))
    finally:
        vllm.close()
        for llm in engines.values():
            llm.engine.shutdown()
    reference = outputs["pagedllm TP=1 (2 threads)"]
    print(f"vLLM {vllm.version}; {args.num_prompts} prompts, {args.rounds} rounds alternated")
    print("| engine | output tok/s (rounds) | median | forward ms/step | greedy = TP=1 |")
    print("| --- | --- | ---: | ---: | --- |")
    for name, values in rates.items():
        fwd = f"{statistics.median(forward[name]):.1f}" if name in forward else "-"
        agree = f"{greedy_agreement(outputs[name], reference)}/{len(reference)}"
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {runs} | {statistics.median(values):.1f} | {fwd} | {agree} |")
    tp2, theirs = (
        statistics.median(rates[n]) for n in ("pagedllm TP=2 (1 thread/rank)", "vLLM TP=2")
    )
    print(f"pagedllm TP=2 / vLLM TP=2 = {tp2 / theirs:.2f}x")


if __name__ == "__main__":
    main()
