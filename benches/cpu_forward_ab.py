"""The one-call CPU decoder (`models/cpu_forward.py`) against the layer-by-layer forward, in one
process: one `LLM`, its runner's `cpu_forward` swapped round by round, decode tok/s of 128 tokens
after a 16-token prompt, alternated; medians and their ratio.

    python benches/cpu_forward_ab.py /work/models/smollm2-Q8_0.gguf --rounds 3 --threads 1 \
        [--kv-cache-dtype int8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.model, cpu_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.worker.runner
    fused = runner.cpu_forward
    if fused is None:
        raise SystemExit(f"{args.model}: the model does not qualify for the fused forward")
    prompt = [{"prompt_token_ids": list(range(100, 116))}]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=1, temperature=0)
    results: dict[str, list[float]] = {"fused": [], "layers": []}
    for _ in range(args.rounds):
        for name, forward in (("fused", fused), ("layers", None)):
            runner.cpu_forward = forward
            llm.generate(prompt, warm, use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            results[name].append(args.tokens / (time.perf_counter() - start))
    for name, values in results.items():
        runs = " ".join(f"{v:.1f}" for v in values)
        print(f"{name}: median {statistics.median(values):.1f} tok/s ({runs})")
    ratio = statistics.median(results["fused"]) / statistics.median(results["layers"])
    print(f"fused / layers: {ratio:.2f}x")


if __name__ == "__main__":
    main()
