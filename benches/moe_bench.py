"""Decode speed of a mixture of experts on the CPU: the grouped-expert kernel (`kernels/cpu_moe.py`)
against a per-token torch loop and against transformers' per-expert torch loop
(`kernels/moe_reference.py`), through the engine.

The model is a random Qwen3-MoE shaped like Qwen3-30B-A3B scaled to this machine (defaults:
hidden 1024, 8 layers, 24 experts of width 512, top-4, 16/4 heads of 64, 32000 tokens: ~0.39 B
parameters, ~0.11 B active per token), written once as safetensors under the names
`save_pretrained` uses. Each variant runs `--concurrency` requests of a short prompt, `--tokens`
greedy tokens each (ignore_eos), after a warm-up request; decode tok/s is the generated tokens over
the wall time of the batch (prefill of 8-token prompts included, a few percent).

    python benches/moe_bench.py [--concurrency 1 8] [--tokens 32] [--threads 2]
        [--variants grouped per_expert_loop per_token_loop] [--folder /tmp/moe_bench_model]

`--write-only --shape large --tokenizer-from DIR` writes instead the model of the llama.cpp
comparison (benches/RESULTS.md): ~1.75 B parameters, ~0.29 B active (16 layers x 64 experts of
width 512, top-8, hidden 1024, a 49152-token vocabulary), bfloat16 in one shard per layer, with
DIR's tokenizer files beside it so that llama.cpp's `convert_hf_to_gguf.py` converts it.

`--kernel` times the bfloat16 expert kernel alone (the large shape's 64 experts, top-8, random
weights; `--concurrency` tokens) against a torch loop of `F.linear` per chosen expert, in
alternated pairs, one thread's CPU time, medians of `--rounds`. `--gguf FILE` runs FILE's decode
through the engine with the one-call CPU decoder and layer by layer (one engine, its runner's
`cpu_forward` swapped, the order alternated), each run's median decode step, medians of
`--rounds` and each pair's ratio (wall time; label it busy on a shared machine); `--fused-ab
FOLDER --dtype bfloat16` the same for a checkpoint folder (the `--shape large` model).
`--gguf FILE --builds A/python B/python --llama-bin DIR --threads 1` compares package copies
(e.g. two commits' release builds) single stream, decode 32 / prefill 64, with llama.cpp's
`llama-bench` in the same rounds (builds alternated): medians and each round's ratios; without
`--llama-bin`, the builds' decode at each `--concurrency` (a fresh process a run, alternated) and
their resident memory after load; `--envs VAR=A VAR=B` compares instead one build under each
setting (an A/B switch inside one build).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.models import moe

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_experts=24,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    intermediate_size=2048,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
)
# Qwen3-30B-A3B's proportions (128 experts, top-8) scaled to ~1.75 B / ~0.29 B active
LARGE = dict(SHAPE, num_hidden_layers=16, num_experts=64, num_experts_per_tok=8, vocab_size=49152)


def write_model(
    folder: Path, s: dict = SHAPE, dtype: torch.dtype = torch.float32, tokenizer: Path | None = None
) -> None:
    """A random Qwen3-MoE checkpoint of shape `s` (per-expert tensors, one shard per layer; no
    tokenizer needed by the bench, which sends token ids; `tokenizer`: a folder whose tokenizer
    files are copied beside it)."""
    if (folder / "config.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * 64, s["num_key_value_heads"] * 64
    width, gen = s["moe_intermediate_size"], torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype)

    index: dict[str, str] = {}

    def save(tensors: dict, name: str) -> None:
        save_file(tensors, folder / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    save(
        {
            "model.embed_tokens.weight": rand(s["vocab_size"], h),
            "model.norm.weight": ones(h),
            "lm_head.weight": rand(s["vocab_size"], h),
        },
        "model-top.safetensors",
    )
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": ones(64),
            p + "self_attn.k_norm.weight": ones(64),
            p + "mlp.gate.weight": rand(s["num_experts"], h) * 4,
        }
        for e in range(s["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            tensors[x + "gate_proj.weight"] = rand(width, h)
            tensors[x + "up_proj.weight"] = rand(width, h)
            tensors[x + "down_proj.weight"] = rand(h, width)
        save(tensors, f"model-layer{i:03d}.safetensors")
    index_file = {"metadata": {}, "weight_map": index}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
        shutil.copy(tokenizer / name, folder / name)
    config = dict(
        s,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        torch_dtype=str(dtype).removeprefix("torch."),
        tie_word_embeddings=False,
    )
    (folder / "config.json").write_text(json.dumps(config))


def per_token_loop(self: moe.Experts, x, weights, ids):
    """One token and one expert at a time: each token re-reads its experts' weights."""
    gate_up, down = self.stacked()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.linear(x[t : t + 1], gate_up[e])
            act = F.silu(h[:, : self.width]) * h[:, self.width :]
            out[t] += weights[t, j] * F.linear(act, down[e])[0]
    return out


def use_variant(variant: str) -> None:
    """Which experts' forward the engine's model runs (patched before the model is loaded)."""
    moe.Experts.forward = ORIGINAL_FORWARD
    moe.Experts.pack = ORIGINAL_PACK
    if variant == "grouped":
        return
    moe.Experts.pack = lambda self: False  # keep the [E, out, in] weights for torch
    if variant == "per_token_loop":
        moe.Experts.forward = per_token_loop


ORIGINAL_FORWARD, ORIGINAL_PACK = moe.Experts.forward, moe.Experts.pack


def decode_tok_s(llm: LLM, concurrency: int, tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [11 + i, 200, 3000, 45, 7, 900, 12, 5 + i]} for i in range(concurrency)
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def kernel_ab(tokens_list: list[int], rounds: int) -> None:
    """The bf16 grouped kernel against the F.linear loop on the large shape (one thread)."""
    from pagedllm.kernels import cpu_moe
    from pagedllm.kernels.moe_reference import moe_experts_reference

    torch.set_num_threads(1)
    s, g = LARGE, torch.Generator().manual_seed(0)
    e, h, i, k = s["num_experts"], s["hidden_size"], s["moe_intermediate_size"], 8
    gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    down = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    packed = cpu_moe.pack_experts(gate_up, down)
    print("| tokens | experts chosen | grouped kernel ms | F.linear loop ms | ratio (median) |")
    print("|---:|---:|---:|---:|---:|")
    for tokens in tokens_list:
        x = torch.randn(tokens, h, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)
        ours, theirs, ratios = [], [], []
        for _ in range(rounds):
            t0 = time.thread_time()
            cpu_moe.moe_experts(x, packed, weights, ids)
            t1 = time.thread_time()
            moe_experts_reference(x, gate_up, down, weights, ids)
            t2 = time.thread_time()
            ours.append(t1 - t0)
            theirs.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
        print(
            f"| {tokens} | {ids.unique().numel()} | {_median(ours) * 1e3:.2f} | "
            f"{_median(theirs) * 1e3:.2f} | {_median(ratios):.2f}x |",
            flush=True,
        )


def fused_ab(
    path: str, concurrency: list[int], tokens: int, threads: int, rounds: int, dtype: str
) -> None:
    """Decode steps of a model (a GGUF file or a checkpoint folder, in `dtype`) with the
    one-call decoder against layer by layer: one engine, its runner's `cpu_forward` swapped
    round by round (the order alternated), each run's median all-decode step (wall ms)."""
    llm = LLM(
        path,
        device="cpu",
        dtype=dtype,
        skip_tokenizer_init=True,
        cpu_threads=threads,
        max_model_len=512,
        enable_prefix_caching=False,
    )
    runner = llm.llm_engine.runner
    fused, forward, steps = runner.cpu_forward, runner.forward, []
    if fused is None:
        raise SystemExit(f"{path}: the model does not qualify for the one-call decoder")

    def timed(inputs, prompt=None):
        start = time.perf_counter()
        out = forward(inputs, prompt)
        steps.append((inputs[0].numel(), time.perf_counter() - start))
        return out

    runner.forward = timed
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    print("| streams | one call step ms | layer by layer step ms | ratios (pairs) |")
    print("|---:|---:|---:|---|")
    for c in concurrency:
        ms: dict[str, list[float]] = {"fused": [], "layers": []}
        for r in range(rounds):
            for name in ("fused", "layers")[:: 1 if r % 2 == 0 else -1]:
                runner.cpu_forward = fused if name == "fused" else None
                prompts = [
                    {"prompt_token_ids": [100 + 7 * i + j for j in range(16)]} for i in range(c)
                ]
                steps.clear()
                llm.generate(prompts, params, use_tqdm=False)
                ms[name].append(1e3 * _median([t for n, t in steps if n == c]))
        ratios = [b / a for a, b in zip(ms["fused"], ms["layers"])]
        listed = " ".join(f"{v:.2f}" for v in ratios)
        print(
            f"| {c} | {_median(ms['fused']):.1f} | {_median(ms['layers']):.1f} | {listed} "
            f"(median {_median(ratios):.2f}x) |",
            flush=True,
        )


def builds_vs_llamacpp(args) -> None:
    """Single-stream decode and prefill of `--gguf` by each package copy of `--builds` (a
    `python` folder each, put first on PYTHONPATH) and by llama.cpp (`--llama-bin`), every round
    llama.cpp then the builds in alternating order; medians and per-round ratios."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    import gguf_vs_llamacpp as vs  # the same runs as its single-stream comparison

    names = ["llama.cpp", *args.builds]
    runs: dict[str, dict[str, list[float]]] = {n: {"decode": [], "prefill": []} for n in names}
    for r in range(args.rounds):
        runs["llama.cpp"]["decode"].append(vs.llama_bench(args.llama_bin, args.gguf, 1, 0, 32))
        runs["llama.cpp"]["prefill"].append(vs.llama_bench(args.llama_bin, args.gguf, 1, 64, 0))
        for build in args.builds if r % 2 == 0 else args.builds[::-1]:
            os.environ["PYTHONPATH"] = build
            got = vs.pagedllm_single(args.gguf, args.threads, 32, 64)
            for what in ("decode", "prefill"):
                runs[build][what].append(got[what])
    for what in ("decode", "prefill"):
        medians = ", ".join(f"{n} {_median(runs[n][what]):.1f}" for n in names)
        print(f"{what} tok/s (medians of {args.rounds}): {medians}")
        for a, b in [(x, "llama.cpp") for x in args.builds] + [(args.builds[-1], args.builds[0])]:
            ratios = [x / y for x, y in zip(runs[a][what], runs[b][what])]
            listed = " ".join(f"{v:.2f}" for v in ratios)
            print(f"  {a} / {b}: {listed} (median {_median(ratios):.2f}x)", flush=True)


# one build's decode of a GGUF file at each concurrency, in a fresh process (`builds_streams`)
_STREAMS = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import moe_bench
from pagedllm import LLM
path, threads, tokens = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, device="cpu", skip_tokenizer_init=True, cpu_threads=threads, max_model_len=256,
          enable_prefix_caching=False)
mem = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
       if k in ("RssAnon", "RssFile")}
rates = {c: moe_bench.decode_tok_s(llm, int(c), tokens) for c in sys.argv[5:]}
print(json.dumps({"rates": rates, "mem_kb": mem}))
"""


def builds_streams(args) -> None:
    """Decode of `--gguf` at each `--concurrency` by each package copy of `--builds` (a `python`
    folder each, first on PYTHONPATH; a fresh process a run, the builds alternated every round),
    or by one build under each `--envs` setting (`VAR=VALUE`: a switch inside one build):
    medians, the last over the first per round, and each run's resident memory after load
    (anonymous: copies; file: the mapped model)."""
    import os
    import subprocess
    import sys

    here = str(Path(__file__).parent)
    conc = [str(c) for c in args.concurrency]
    # (label, PYTHONPATH, extra environment) per variant
    variants = [(b, b, {}) for b in args.builds]
    if args.envs:
        build = args.builds[0]
        variants = [(e, build, dict([e.split("=", 1)])) for e in args.envs]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    for r in range(args.rounds):
        for label, build, extra in variants if r % 2 == 0 else variants[::-1]:
            env = {**os.environ, "PYTHONPATH": build, "OMP_NUM_THREADS": str(args.threads)}
            cmd = [sys.executable, "-c", _STREAMS, here, args.gguf, str(args.threads)]
            out = subprocess.run(
                [*cmd, str(args.tokens), *conc],
                check=True,
                capture_output=True,
                text=True,
                env={**env, **extra},
            ).stdout
            runs[label].append(json.loads(out.strip().splitlines()[-1]))
    labels = [label for label, _, _ in variants]
    first, last = labels[0], labels[-1]
    for build in labels:
        anon, file = (runs[build][-1]["mem_kb"][k] / 1024 for k in ("RssAnon", "RssFile"))
        print(f"{build}: RssAnon {anon:.0f} MiB, RssFile {file:.0f} MiB")
    print("| streams | " + " | ".join(f"{b} tok/s" for b in labels) + " | last / first |")
    print("|---:|" + "---:|" * len(labels) + "---|")
    for c in conc:
        medians = " | ".join(f"{_median([x['rates'][c] for x in runs[b]]):.1f}" for b in labels)
        ratios = [x["rates"][c] / y["rates"][c] for x, y in zip(runs[last], runs[first])]
        listed = " ".join(f"{v:.2f}" for v in ratios)
        print(f"| {c} | {medians} | {listed} (median {_median(ratios):.2f}x) |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--variants", nargs="+", default=["grouped", "per_expert_loop", "per_token_loop"]
    )
    p.add_argument("--folder", type=Path, default=Path("/tmp/moe_bench_model"))
    p.add_argument("--shape", choices=["small", "large"], default="small")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tokenizer-from", type=Path, help="copy this folder's tokenizer files")
    p.add_argument("--write-only", action="store_true", help="write the model, run nothing")
    p.add_argument("--kernel", action="store_true", help="the bf16 expert kernel alone")
    p.add_argument("--gguf", help="a GGUF file: one-call decoder against layer by layer")
    p.add_argument("--fused-ab", help="a model folder (in --dtype): the same as --gguf")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--llama-bin", type=Path, help="with --gguf and --builds: llama.cpp's bin")
    p.add_argument("--builds", nargs="+", help="package copies' python folders to compare")
    p.add_argument(
        "--envs", nargs="+", help="with --gguf and one --builds: VAR=VALUE settings to compare"
    )
    args = p.parse_args()
    if args.gguf and args.builds and args.llama_bin:
        builds_vs_llamacpp(args)
        return 0
    if args.gguf and args.builds:
        builds_streams(args)
        return 0
    if args.kernel:
        kernel_ab(args.concurrency, args.rounds)
        return 0
    if args.gguf or args.fused_ab:
        model = args.gguf or args.fused_ab
        fused_ab(model, args.concurrency, args.tokens, args.threads, args.rounds, args.dtype)
        return 0
    s = LARGE if args.shape == "large" else SHAPE
    write_model(args.folder, s, getattr(torch, args.dtype), args.tokenizer_from)
    if args.write_only:
        return 0
    expert = 3 * s["hidden_size"] * s["moe_intermediate_size"]
    layers = s["num_hidden_layers"]
    print(
        f"model: random Qwen3-MoE, {layers} layers x {s['num_experts']} experts "
        f"(top-{s['num_experts_per_tok']}), {expert * s['num_experts'] * layers / 1e6:.0f} M "
        f"expert parameters, {expert * s['num_experts_per_tok'] * layers / 1e6:.0f} M active "
        f"per token; float32; {args.threads} threads"
    )
    print("| variant | concurrency | decode tok/s |")
    print("|---|---:|---:|")
    for variant in args.variants:
        use_variant(variant)
        llm = LLM(
            str(args.folder),
            device="cpu",
            skip_tokenizer_init=True,
            cpu_threads=args.threads,
            max_model_len=256,
            enable_prefix_caching=False,
        )
        for concurrency in args.concurrency:
            rate = decode_tok_s(llm, concurrency, args.tokens)
            print(f"| {variant} | {concurrency} | {rate:.1f} |", flush=True)
        llm.engine.shutdown()
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
