"""Decode attention over a quantized KV cache (`kv_cache_dtype`): the Rust CPU kernel
(`cpu_paged_attention`) over an int8 (or fp8) cache against the same kernel over the model's
float cache, at decode shapes (one query token per sequence) and long contexts, where the bytes
of K and V read per step dominate. Every variant is called in turn on the same positions
(alternated call by call in one process, so a busy machine slows them alike); median ms per call.

    python benches/cpu_attention_kv_quant.py --batch 1 16 --context 1024 4096 16384 \
        [--variants float32 int8 bfloat16 fp8_e4m3] [--threads 1] [--layers 30 --between-mb 4]

As in a decode step, each variant has `--layers` caches (a model's layers: the same keys and
values in separate memory), called one after the other, and `--between-mb` of other memory is
read (untimed) before each call, as a layer's weights are: a layer's cache comes from memory,
not from the last call's cache lines. `--layers 1 --between-mb 0` times one cache read again
and again (hot in L2 / L3 at small batches and contexts: the kernels' arithmetic alone).

The default shape is the 56M Llama's (`benches/make_llama56m.py`): 8 query heads, 4 KV heads,
head size 64, block size 16. Caches are allocated as the engine does (`worker.cache_engine
.host_zeros`: huge pages where granted), blocks scattered over them in a random order; a
quantized cache is coded from the same random keys and values (`kernels.reference`). q and the
output are float32, except for the bfloat16 variants (bfloat16 / fp8 caches under a bfloat16
model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm import _core
from pagedllm.attention.cpu_attention import _cache_view
from pagedllm.kernels.cpu_arrays import numpy_view
from pagedllm.kernels.reference import kv_format, kv_row_size, quantize_rows
from pagedllm.worker.cache_engine import host_zeros

# variant -> (model dtype, cache dtype)
VARIANTS = {
    "float32": (torch.float32, torch.float32),
    "int8": (torch.float32, torch.int8),
    "fp8_e4m3": (torch.float32, torch.float8_e4m3fn),
    "fp8_e5m2": (torch.float32, torch.float8_e5m2),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "bf16+int8": (torch.bfloat16, torch.int8),
    "bf16+fp8_e4m3": (torch.bfloat16, torch.float8_e4m3fn),
    "bf16+fp8_e5m2": (torch.bfloat16, torch.float8_e5m2),
}


def cache_like(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`values` [blocks, block_size, kv_heads, head_dim] as a cache of `cache_dtype`."""
    shape = (*values.shape[:3], kv_row_size(values.shape[3], cache_dtype))
    cache = host_zeros(shape, cache_dtype)
    for b in range(0, values.shape[0], 4096):  # in slices: bounded temporaries
        rows = values[b : b + 4096]
        coded = rows.to(cache_dtype) if kv_format(cache_dtype) == "auto" else None
        cache[b : b + 4096] = coded if coded is not None else quantize_rows(rows, cache_dtype)
    return cache


def make_calls(variants, batch, context, heads, kv_heads, head_dim, block_size, threads, layers):
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q32 = torch.randn(batch, heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, blocks_per_seq)
    calls = {}
    for name in variants:
        model_dtype, cache_dtype = VARIANTS[name]
        q = q32.to(model_dtype)
        k_cache, v_cache = cache_like(k, cache_dtype), cache_like(v, cache_dtype)
        calls[name] = []
        for layer in range(layers):  # the same codes in separate memory, as a model's layers
            k_layer = k_cache if layer == 0 else copy_cache(k_cache)
            v_layer = v_cache if layer == 0 else copy_cache(v_cache)
            calls[name].append(
                (
                    numpy_view(q),
                    _cache_view(k_layer),
                    _cache_view(v_layer),
                    torch.arange(batch + 1, dtype=torch.int32).numpy(),
                    torch.full((batch,), context, dtype=torch.int32).numpy(),
                    tables.numpy(),
                    head_dim**-0.5,
                    numpy_view(torch.empty_like(q)),
                    threads,
                    kv_format(cache_dtype),
                )
            )
    return calls


def copy_cache(cache: torch.Tensor) -> torch.Tensor:
    """`cache` in new memory allocated as the engine allocates it."""
    out = host_zeros(tuple(cache.shape), cache.dtype)
    out.copy_(cache)
    return out


def layer_count(args, float_bytes: int) -> int:
    """`--layers`, fewer where they would hold more than `--cache-gb` of float32 K/V (at least
    2: a layer's cache is still out of the caches by its next call, after another's)."""
    return max(min(2, args.layers), min(args.layers, int(args.cache_gb * 1e9 / float_bytes)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--variants", nargs="+", default=["float32", "int8"], choices=list(VARIANTS))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    # calls per variant: about this many bytes of float32 K/V read in all, at least 7 calls
    p.add_argument("--budget-gb", type=float, default=12.0)
    p.add_argument("--layers", type=int, default=30, help="caches a variant, called in turn")
    p.add_argument("--cache-gb", type=float, default=2.0, help="float32 K/V bytes, all layers")
    p.add_argument("--between-mb", type=float, default=4.0, help="memory read before a call")
    args = p.parse_args()
    between = torch.ones(max(1, int(args.between_mb * 2**20) // 4))
    for batch in args.batch:
        for context in args.context:
            shape = (batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size)
            float_bytes = 2 * batch * context * args.kv_heads * args.head_dim * 4
            layers = layer_count(args, float_bytes)
            calls = make_calls(args.variants, *shape, args.threads, layers)
            repeats = max(7, min(300, int(args.budget_gb * 1e9 / float_bytes)))
            times = {name: [] for name in calls}
            for i in range(repeats):
                for name, layer_calls in calls.items():
                    call = layer_calls[i % layers]
                    if args.between_mb > 0:
                        between.sum()  # a layer's weights, read between its attention calls
                    start = time.perf_counter()
                    _core.cpu_paged_attention(*call)
                    times[name].append(time.perf_counter() - start)
            ms = {name: round(1e3 * statistics.median(t), 4) for name, t in times.items()}
            base = ms[args.variants[0]]
            ratio = {name: round(t / base, 3) for name, t in ms.items()}
            print(
                json.dumps(
                    {
                        "batch": batch,
                        "context": context,
                        "repeats": repeats,
                        "layers": layers,
                        "between_mb": args.between_mb,
                        "median_ms": ms,
                        f"x_{args.variants[0]}": ratio,
                    }
                ),
                flush=True,
            )
            del calls
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
