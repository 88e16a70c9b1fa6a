"""The quantized-weight CPU kernels (`kernels/cpu_quant.py`, `rust/src/cpu/quant/`) per ggml type
against the float32 panel kernel (`kernels/cpu_linear.py`) on the same shape, calls alternated
between the two, median wall time of `--repeats` calls each. Decode (1 row of x) is bound by
the weight's bytes: GB/s is those bytes over the time (the float32 kernel reads 4 bytes a
weight, Q4_0 0.5625); prefill (512 rows) by arithmetic: GFLOP/s is 2·M·N·K over the time.

    python benches/cpu_quant_bench.py [--shapes 1536x576 5632x2048] [--rows 1 512]
        [--types Q8_0 Q4_K ...] [--repeats 9] [--threads 1] [--activations f32 int8 int16]

`--activations` (default f32) times `quant_linear(..., activations=A)` for each A (int8: x
quantized to 8 bits, integer dots, decode rows of the 32-element block types; int16: 16 bits,
every quantized type; other rows take the f32 path), all calls alternated; each A after the first
gets its ms and its speed against the first's.

`--isa L1 L2 ...` compares instruction-set levels (`PAGEDLLM_CPU_ISA`, read once per process): each
of `--rounds` rounds runs the kernel table once per level in a fresh process (`--activations`'
first value, default int16), alternated; prints each case's median ms per level and the median
of the rounds' ratios to the first level (> 1: the other level is faster).

    python benches/cpu_quant_bench.py --isa avx2 avx512 --rows 1 512 --rounds 3

`--quality MODEL.gguf` instead measures what quantized activations cost a model: `--tokens`
tokens of docs/ARCHITECTURE.md (512-token prompts) teacher-forced (`prompt_logprobs=1`) 8 tokens a
step (`max_num_batched_tokens=8`: every forward has decode-sized rows, so every quantized product
takes the integer path; in serving, prefill chunks above 8 rows keep float32 activations), once
per `--activations` value (default f32 int8 int16; `cpu_quant.ACTIVATIONS` switched in the same
process); prints each perplexity and each one's top-1 agreement with the first's.

    python benches/cpu_quant_bench.py --quality /work/models/smollm2-Q8_0.gguf [--tokens 2048]

`--decode MODEL.gguf` measures single-stream decode end to end: one `LLM` (`--threads` threads),
greedy `--tokens` tokens (default 128) after a 16-token prompt, once per `--activations` value
(default f32 int16) a round, `--rounds` rounds alternated in one process; prints each round's
tok/s, the medians and the median of the rounds' ratios to the first value.

    python benches/cpu_quant_bench.py --decode /work/models/smollm2-Q8_0.gguf --rounds 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pagedllm.kernels import cpu_linear, cpu_quant

# byte offsets of the f16 scales of the types `gguf` cannot quantize (random blocks instead)
_RANDOM_BLOCK_SCALES = {cpu_quant.Q4_K: (0, 2), cpu_quant.Q5_K: (0, 2), cpu_quant.Q6_K: (208,)}


def weight_rows(qtype: int, dense: np.ndarray, seed: int) -> np.ndarray:
    """`dense [N, K]` in `qtype` (random valid blocks for the K-quants) as uint8 [N, row_bytes]."""
    n, k = dense.shape
    if qtype not in _RANDOM_BLOCK_SCALES:
        rows = gguf_quants.quantize(dense, GGMLQuantizationType(qtype))
        return np.ascontiguousarray(rows).view(np.uint8).reshape(n, -1)
    rng = np.random.default_rng(seed)
    elems, size = cpu_quant.block_shape(qtype)
    blocks = rng.integers(0, 256, size=(n * k // elems, size), dtype=np.uint8)
    for at in _RANDOM_BLOCK_SCALES[qtype]:
        scale = rng.uniform(-0.02, 0.02, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def median_seconds(call, repeats: int) -> float:
    call()  # warm: pages, caches, the pool's threads
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def teacher_forced(llm, ids: list[int], chunk: int = 512) -> tuple[list[int], list[float]]:
    """Each position's most likely next token and the true next token's logprob."""
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": ids[i : i + chunk]} for i in range(0, len(ids), chunk)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    top1, logprobs = [], []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        for token, ranked in zip(prompt["prompt_token_ids"][1:], out.prompt_logprobs[1:]):
            top1.append(next(t for t, lp in ranked.items() if lp.rank == 1))
            logprobs.append(ranked[token].logprob)
    return top1, logprobs


def quality(model: str, tokens: int, activations: list[str]) -> int:
    from pagedllm import LLM

    llm = LLM(
        model,
        max_num_batched_tokens=8,
        scheduling="chunked_prefill",
        enable_prefix_caching=False,  # the second pass must recompute every position
        cpu_threads=1,
    )
    text = (Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    ids = llm.get_tokenizer().encode(text)[:tokens]
    runs = {}
    for name in activations:
        cpu_quant.ACTIVATIONS = name  # what the quantized layers pass per call
        runs[name] = teacher_forced(llm, ids)
    base = activations[0]
    top_b, lp_b = runs[base]
    ppl_b = math.exp(-sum(lp_b) / len(lp_b))
    print(f"{model}: {len(top_b)} positions teacher-forced, 8 tokens a step")
    print(f"{base} activations: perplexity {ppl_b:.4f}")
    for name in activations[1:]:
        top, lp = runs[name]
        agree = sum(a == b for a, b in zip(top_b, top)) / len(top_b)
        ppl = math.exp(-sum(lp) / len(lp))
        print(
            f"{name} activations: perplexity {ppl:.4f} ({ppl / ppl_b - 1:+.3%} vs {base}), "
            f"top-1 agreement with {base} {agree:.2%}"
        )
    return 0


def decode(model: str, activations: list[str], rounds: int, tokens: int, threads: int) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, cpu_threads=threads)
    prompt = [{"prompt_token_ids": list(range(100, 116))}]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    warm = SamplingParams(max_tokens=1, temperature=0)
    tok_s: dict[str, list[float]] = {name: [] for name in activations}
    for r in range(rounds):
        for name in activations:
            cpu_quant.ACTIVATIONS = name  # what the quantized layers pass per call
            llm.generate(prompt, warm, use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            tok_s[name].append(tokens / (time.perf_counter() - start))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.1f} tok/s" for n, v in tok_s.items()))
    base = activations[0]
    print(f"{model}: {threads} thread(s), {tokens} tokens, medians of {rounds} rounds")
    for name, values in tok_s.items():
        ratios = [v / b for v, b in zip(values, tok_s[base])]
        print(
            f"{name}: {statistics.median(values):.1f} tok/s, median ratio to {base} "
            f"{statistics.median(ratios):.3f}x"
        )
    return 0


def isa_ab(levels: list[str], rounds: int, argv: list[str]) -> int:
    """The kernel table once per level and round in fresh processes, alternated."""
    ms: dict[tuple, dict[str, list[float]]] = {}
    for r in range(rounds):
        for level in levels:
            env = dict(os.environ, PAGEDLLM_CPU_ISA=level)
            out = subprocess.run(
                [sys.executable, __file__, *argv, "--json"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for line in out.splitlines():
                case = json.loads(line)
                key = (case["shape"], case["rows"], case["type"])
                ms.setdefault(key, {lv: [] for lv in levels})[level].append(case["ms"])
        print(f"round {r} done", file=sys.stderr, flush=True)
    base = levels[0]
    head = "".join(f" {lv} ms |" for lv in levels) + "".join(
        f" {lv} vs {base} |" for lv in levels[1:]
    )
    print(f"medians of {rounds} alternated rounds (one process per level and round)")
    print("| shape N x K | rows | type |" + head)
    print("| --- | ---: | --- |" + " ---: |" * (2 * len(levels) - 1))
    for (shape, rows, qtype), per in ms.items():
        cols = "".join(f" {statistics.median(per[lv]):.3f} |" for lv in levels)
        for lv in levels[1:]:
            ratios = [b / v for b, v in zip(per[base], per[lv])]
            cols += f" {statistics.median(ratios):.2f}x |"
        print(f"| {shape} | {rows} | {qtype} |" + cols)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["576x1536", "5632x2048"], help="NxK")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    p.add_argument(
        "--types", nargs="+", default=[cpu_quant.type_name(t) for t in sorted(cpu_quant.SUPPORTED)]
    )
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1, help="torch's (and so the kernels') threads")
    p.add_argument(
        "--activations",
        nargs="+",
        choices=cpu_quant.ACTIVATION_CHOICES,
        help="quant_linear's activations to time (default f32) or to compare (--quality: "
        "default f32 int8 int16, the first the baseline)",
    )
    p.add_argument("--quality", metavar="MODEL", help="quantized activations' cost on a model")
    p.add_argument("--decode", metavar="MODEL", help="decode tok/s per activations, end to end")
    p.add_argument("--rounds", type=int, default=5, help="--decode's / --isa's alternated rounds")
    p.add_argument("--isa", nargs="+", help="instruction-set levels to compare (kernel table)")
    p.add_argument("--json", action="store_true", help="one JSON line a case (--isa's children)")
    p.add_argument(
        "--tokens", type=int, help="--quality's teacher-forced tokens (2048), --decode's (128)"
    )
    args = p.parse_args()
    if args.isa:
        argv = list(sys.argv[1:])
        at = argv.index("--isa")
        end = at + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        argv = argv[:at] + argv[end:]
        if not args.activations:
            argv += ["--activations", "int16"]
        return isa_ab(args.isa, args.rounds, argv)
    if args.decode:
        acts = args.activations or ["f32", "int16"]
        return decode(args.decode, acts, args.rounds, args.tokens or 128, args.threads)
    if args.quality:
        return quality(
            args.quality,
            args.tokens or 2048,
            args.activations or list(cpu_quant.ACTIVATION_CHOICES),
        )
    acts = args.activations or ["f32"]
    torch.set_num_threads(args.threads)
    types = [int(GGMLQuantizationType[name]) for name in args.types]
    if args.json:
        return kernel_json(args, types, acts[0])
    print(f"{args.threads} thread(s), median of {args.repeats} calls each, alternated")
    print(
        f"quant ms: quant_linear with {acts[0]} activations; f32 ms: the float32 panel kernel "
        "on the same shape"
    )
    extra_head = "".join(f" {a} ms | {a} vs {acts[0]} |" for a in acts[1:])
    print(
        "| shape N x K | rows | type | bytes/weight | quant ms | f32 ms | speed vs f32 "
        "| weight GB/s | GFLOP/s |" + extra_head
    )
    print(
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        + " ---: |" * (2 * len(acts[1:]))
    )
    with torch.inference_mode():
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            dense = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
            packed = cpu_linear.pack(torch.from_numpy(dense))
            for qtype in types:
                if k % cpu_quant.block_shape(qtype)[0]:
                    continue  # rows of whole blocks only (llama.cpp picks another type then)
                rows = weight_rows(qtype, dense, seed=qtype)
                w = cpu_quant.make_weight([(qtype, torch.from_numpy(rows))], k)
                for m in args.rows:
                    x = torch.randn(m, k)
                    calls = {
                        f"quant {a}": lambda x=x, w=w, a=a: cpu_quant.quant_linear(
                            x, w, None, activations=a
                        )
                        for a in acts
                    }
                    calls["f32"] = lambda x=x, p=packed: cpu_linear.linear(x, p.panels, None, p)
                    times = {name: [] for name in calls}
                    for _ in range(3):  # three rounds, alternated: all see the same load
                        for name, call in calls.items():
                            times[name].append(median_seconds(call, args.repeats))
                    tq = statistics.median(times[f"quant {acts[0]}"])
                    tf = statistics.median(times["f32"])
                    extra_cols = ""
                    for a in acts[1:]:
                        ta = statistics.median(times[f"quant {a}"])
                        extra_cols += f" {ta * 1e3:.3f} | {tq / ta:.2f}x |"
                    print(
                        f"| {n} x {k} | {m} | {cpu_quant.type_name(qtype)} "
                        f"| {rows.nbytes / (n * k):.4g} | {tq * 1e3:.3f} | {tf * 1e3:.3f} "
                        f"| {tf / tq:.2f}x | {rows.nbytes / tq / 1e9:.1f} "
                        f"| {2 * m * n * k / tq / 1e9:.1f} |" + extra_cols,
                        flush=True,
                    )
    return 0


def kernel_json(args, types: list[int], activations: str) -> int:
    """`quant_linear`'s median ms per case, one JSON line each (`--isa`'s children)."""
    with torch.inference_mode():
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            dense = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
            for qtype in types:
                if k % cpu_quant.block_shape(qtype)[0]:
                    continue
                rows = weight_rows(qtype, dense, seed=qtype)
                w = cpu_quant.make_weight([(qtype, torch.from_numpy(rows))], k)
                for m in args.rows:
                    x = torch.randn(m, k)

                    def call(x=x, w=w):
                        return cpu_quant.quant_linear(x, w, None, activations=activations)

                    t = median_seconds(call, args.repeats)
                    case = {"shape": shape, "rows": m, "type": cpu_quant.type_name(qtype)}
                    print(json.dumps({**case, "ms": t * 1e3}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
