"""The Rust CPU paged-attention kernel alone (`_core.cpu_paged_attention`) at decode shapes, in
float32 or bfloat16: median microseconds per call over repeated calls, one thread.

    python benches/cpu_attention_dtype.py --dtype bfloat16 --batch 1 8 --context 256 1024

The default shape is the 56M Llama's (`benches/make_llama56m.py`): 8 query heads, 4 KV heads,
head size 64, block size 16. bfloat16 crosses as its uint16 bits, as the engine passes it. For a
before/after of the float32 kernel, run the script with another build's package first on
PYTHONPATH (it calls the float32 kernel with plain numpy arrays, which every build takes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pagedllm import _core


def arrays(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def time_call(dtype, batch, context, heads, kv_heads, head_dim, block_size, repeats) -> float:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, blocks_per_seq)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    out = torch.empty_like(q)
    args = (
        arrays(q),
        arrays(k_cache),
        arrays(v_cache),
        qsl.numpy(),
        lens.numpy(),
        tables.numpy(),
        head_dim**-0.5,
        arrays(out),
        1,
    )
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _core.cpu_paged_attention(*args)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=400)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    for batch in args.batch:
        for context in args.context:
            us = time_call(
                dtype,
                batch,
                context,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.block_size,
                args.repeats,
            )
            row = {"dtype": args.dtype, "batch": batch, "context": context}
            print(json.dumps({**row, "us_per_call": round(us, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
