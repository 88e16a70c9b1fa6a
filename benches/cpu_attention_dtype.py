"""The Rust CPU paged-attention kernel alone (`cpu_paged_attention`) at decode shapes, float32
against bfloat16, and optionally one build of the extension against another: every variant is
called in turn on the same inputs (alternated call by call in one process, so a busy machine
slows them alike), one thread; median microseconds per call.

    python benches/cpu_attention_dtype.py --batch 1 8 --context 256 1024 \
        [--build main=/path/to/main/_core.abi3.so]

The default shape is the 56M Llama's (`benches/make_llama56m.py`): 8 query heads, 4 KV heads,
head size 64, block size 16. bfloat16 crosses as its uint16 bits, as the engine passes it. A
`--build` (another compiled `_core`, e.g. main's) is timed on float32 only, the dtype every build
takes: the before/after of the float32 kernel.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import time

import numpy as np
import torch

from pagedllm import _core


def load_build(name: str, path: str):
    """Another compiled `_core` loaded beside ours under its own module name."""
    loader = importlib.machinery.ExtensionFileLoader(f"{name}._core", path)
    spec = importlib.util.spec_from_file_location(f"{name}._core", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def call_args(dtype, batch, context, heads, kv_heads, head_dim, block_size) -> tuple:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, blocks_per_seq)
    return (
        as_numpy(q),
        as_numpy(k_cache),
        as_numpy(v_cache),
        torch.arange(batch + 1, dtype=torch.int32).numpy(),
        torch.full((batch,), context, dtype=torch.int32).numpy(),
        tables.numpy(),
        head_dim**-0.5,
        as_numpy(torch.empty_like(q)),
        1,
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--build", action="append", default=[], metavar="NAME=PATH")
    args = p.parse_args()
    builds = [name_path.split("=", 1) for name_path in args.build]
    others = {name: load_build(name, path) for name, path in builds}
    for batch in args.batch:
        for context in args.context:
            shape = (batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size)
            inputs = {dt: call_args(getattr(torch, dt), *shape) for dt in ("float32", "bfloat16")}
            variants = {"float32": (_core, inputs["float32"])}
            variants["bfloat16"] = (_core, inputs["bfloat16"])
            for name, module in others.items():
                variants[f"{name} float32"] = (module, inputs["float32"])
            times = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (module, call) in variants.items():
                    start = time.perf_counter()
                    module.cpu_paged_attention(*call)
                    times[name].append(time.perf_counter() - start)
            us = {name: round(1e6 * statistics.median(t), 1) for name, t in times.items()}
            print(json.dumps({"batch": batch, "context": context, "median_us": us}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
