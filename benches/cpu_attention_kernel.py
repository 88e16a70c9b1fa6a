"""The Rust CPU paged-attention kernel (`cpu_paged_attention`) at the offline mixed workload's
step shapes, against torch's `scaled_dot_product_attention` over the same contexts gathered into
contiguous tensors (causal, grouped heads expanded) and, optionally, against another build of the
extension (e.g. main's, for a before/after). Every variant is called in turn on the same inputs
(alternated call by call in one process, so a busy machine slows them alike); median
milliseconds per call, GFLOP/s (4 * query-key pairs * head size per head: QK^T and P.V) and
GB/s (every context's K and V read once, the bytes a decode step must stream; compare with the
floor `cargo run --release --example kv_stream_floor` measures over the same scattered blocks).

    python benches/cpu_attention_kernel.py [--dtype float32 bfloat16] [--threads 1] \
        [--build main=/path/to/main/_core.abi3.so] [--steps decode-16 decode-64] [--huge-pages]

`--huge-pages` adds every build on caches allocated as the engine allocates them (`host_zeros`,
transparent huge pages), alternated with torch's allocation (4 KiB pages).

The shape is the 56M Llama's (`benches/make_llama56m.py`): 8 query heads, 4 KV heads, head
size 64, block size 16. Steps (new tokens, context) per sequence:
prefill: 8 prompts of 32-256 tokens; mixed: 3 prefill chunks and 48 decodes at contexts
100-500; decode-B: B sequences of one token at context 512. The torch reference's time includes
its gather of the contexts out of the paged cache (what the engine's torch path pays).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from cpu_attention_dtype import as_numpy, load_build

from pagedllm import _core
from pagedllm.worker.cache_engine import host_zeros

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def steps() -> dict[str, list[tuple[int, int]]]:
    """(new tokens, context length) per sequence of each benchmarked step."""
    rng = np.random.default_rng(0)
    prefill = [(n, n) for n in (32, 64, 96, 128, 160, 192, 224, 256)]
    chunks = [(256, 256), (100, 180), (37, 37)]
    decodes = [(1, int(c)) for c in rng.integers(100, 501, size=48)]
    out = {"prefill-8": prefill, "mixed-3+48": chunks + decodes}
    for b in (1, 16, 64):
        out[f"decode-{b}"] = [(1, 512)] * b
    return out


class Step:
    """A step's tensors: the paged cache holding every sequence's context, q, the metadata."""

    def __init__(self, seqs: list[tuple[int, int]], dtype: torch.dtype, huge: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        widths = [-(-ctx // BLOCK) for _, ctx in seqs]
        num_blocks = sum(widths)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=g).to(dtype)
        self.v_cache = torch.randn(shape, generator=g).to(dtype)
        if huge:  # the engine's allocation (`CacheEngine`): huge pages where the kernel has them
            self.k_cache = host_zeros(shape, dtype).copy_(self.k_cache)
            self.v_cache = host_zeros(shape, dtype).copy_(self.v_cache)
        perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
        self.tables = torch.zeros(len(seqs), max(widths), dtype=torch.int32)
        at = 0
        for s, w in enumerate(widths):
            self.tables[s, :w] = perm[at : at + w]
            at += w
        total = sum(n for n, _ in seqs)
        self.q = torch.randn(total, HEADS, HEAD_DIM, generator=g).to(dtype)
        self.seqs = seqs
        self.qsl = np.cumsum([0] + [n for n, _ in seqs]).astype(np.int32)
        self.lens = np.array([ctx for _, ctx in seqs], dtype=np.int32)
        self.flops = sum(
            4 * HEADS * HEAD_DIM * sum(ctx - n + i + 1 for i in range(n)) for n, ctx in seqs
        )
        # every context's keys and values read once: what a decode step must stream
        self.kv_bytes = 2 * sum(ctx for _, ctx in seqs) * KV_HEADS * HEAD_DIM
        self.kv_bytes *= self.k_cache.element_size()

    def kernel(self, core, threads: int):
        out = np.empty(self.q.shape, dtype=as_numpy(self.q).dtype)
        args = (
            as_numpy(self.q),
            as_numpy(self.k_cache),
            as_numpy(self.v_cache),
            self.qsl,
            self.lens,
            self.tables.numpy(),
            HEAD_DIM**-0.5,
            out,
            threads,
        )

        def call():
            core.cpu_paged_attention(*args)
            return out

        return call

    def torch_reference(self):
        """Gathers each context and runs SDPA per sequence (causal over its new tokens)."""

        def call():
            outs = []
            for s, (n, ctx) in enumerate(self.seqs):
                blocks = self.tables[s, : -(-ctx // BLOCK)].long()
                k = self.k_cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx]
                v = self.v_cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx]
                k = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
                v = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
                q = self.q[self.qsl[s] : self.qsl[s + 1]].transpose(0, 1)
                # query i sits at position ctx - n + i: a bottom-right aligned causal mask
                mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
                outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
            return torch.cat(outs)

        return call


def median_ms(fns: dict, repeats: int, budget_s: float) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for i in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if i >= 4 and time.perf_counter() - start > budget_s:
            break
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--budget-s", type=float, default=6.0, help="time per step and dtype")
    p.add_argument("--no-torch", action="store_true", help="skip the torch reference")
    p.add_argument("--build", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--steps", nargs="+", help="only these steps (e.g. decode-16 decode-64)")
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="also time every build on caches allocated as the engine does (`host_zeros`: "
        "transparent huge pages), alternated with torch's allocation",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"ours": _core}
    builds.update({name: load_build(name, path) for name, path in map(_split, args.build)})
    allocs = ["", "/huge"] if args.huge_pages else [""]
    names = [b + a for b in builds for a in allocs]
    print(
        f"{'step':<12} {'dtype':<9} "
        + " ".join(f"{n + ' ms':>15} {'GF/s':>5} {'GB/s':>5}" for n in names)
        + ("" if args.no_torch else f" {'torch ms':>10} {'GF/s':>5}")
    )
    for name, seqs in steps().items():
        if args.steps and name not in args.steps:
            continue
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            step = Step(seqs, dtype)
            fns = {}
            huge = Step(seqs, dtype, huge=True) if args.huge_pages else None
            for b, core in builds.items():
                fns[b] = step.kernel(core, args.threads)
                if huge is not None:
                    # each call after one over the other copy: none finds the last one's
                    # bytes in the L3 cache (decode-16's 16 MB fit in it)
                    fns[b + "/huge"] = huge.kernel(core, args.threads)
            if not args.no_torch:
                fns["torch"] = step.torch_reference()
            ours = fns["ours"]()
            got = torch.from_numpy(ours.copy())
            if dtype_name == "bfloat16":  # crossed as its uint16 bits
                got = got.view(torch.bfloat16)
            if not args.no_torch:
                err = (got.float() - fns["torch"]().float()).abs().max().item()
                assert err < (2e-2 if dtype_name == "bfloat16" else 1e-4), f"{name}: error {err}"
            if args.huge_pages:  # the same inputs: the same outputs, bit for bit
                assert np.array_equal(fns["ours/huge"](), ours), f"{name}: huge pages differ"
            ms = median_ms(fns, args.repeats, args.budget_s)
            gf = {n: f"{step.flops / ms[n] / 1e6:>5.1f}" for n in fns}
            cols = " ".join(
                f"{ms[n]:>15.3f} {gf[n]} {step.kv_bytes / ms[n] / 1e6:>5.1f}"
                if n != "torch"
                else f"{ms[n]:>10.3f} {gf[n]}"
                for n in fns
            )
            print(f"{name:<12} {dtype_name:<9} {cols}", flush=True)
    return 0


def _split(name_path: str) -> tuple[str, str]:
    name, path = name_path.split("=", 1)
    return name, path


if __name__ == "__main__":
    raise SystemExit(main())
