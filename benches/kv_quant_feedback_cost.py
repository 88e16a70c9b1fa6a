"""The key store's error feedback (`worker/kv_calibration.py`'s matrices, `cpu_store_kvcache`'s
`key_feedback`) against the nearest-rounding store, in one process, alternated: microseconds per
stored token of one layer (its `--kv-heads` key and value rows), for `--tokens` rows a call (1: a
decode step; 512: a prefill chunk). Three stores: plain (no feedback), feedback with a zero
diagonal (the first scale byte only) and feedback with the scale byte searched (weights on the
diagonal, as the calibration gives). Multiply by the model's layers for a token's whole store.

    python benches/kv_quant_feedback_cost.py [--kv-cache-dtype fp8_e4m3] [--kv-heads 3] \
        [--head-dim 64] [--tokens 1 512] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from pagedllm import _core
from pagedllm.attention.cpu_attention import _cache_view
from pagedllm.kernels import reference as ref


def _timed(x, kc, vc, slots, kv_cache_dtype, calls, feedback) -> float:
    """Microseconds a stored token (of one layer) over `calls` stores of `x`."""
    start = time.perf_counter()
    for _ in range(calls):
        _core.cpu_store_kvcache(x, x, kc, vc, slots, kv_cache_dtype, feedback)
    return (time.perf_counter() - start) / (calls * len(x)) * 1e6


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 512])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    kvh, d = args.kv_heads, args.head_dim
    dtype = ref.kv_storage_dtype(args.kv_cache_dtype, torch.float32)
    g = torch.Generator().manual_seed(0)
    upper = torch.triu(torch.randn(kvh, d, d, generator=g) * 0.1, diagonal=1)
    weights = torch.diag_embed(torch.rand(kvh, d, generator=g) + 0.5)
    stores = {"plain": None, "feedback": upper.numpy(), "search": (upper + weights).numpy()}
    for tokens in args.tokens:
        x = torch.randn(tokens, kvh, d, generator=g).numpy()
        cache = torch.zeros(max(tokens, 16), 1, kvh, d + 1, dtype=dtype)
        kc, vc = _cache_view(cache), _cache_view(cache.clone())
        slots = np.arange(tokens, dtype=np.int64)
        run = (x, kc, vc, slots, args.kv_cache_dtype, max(1, 4096 // tokens))
        times = {name: [] for name in stores}
        for r in range(args.rounds):
            names = list(stores)[r % 3 :] + list(stores)[: r % 3]  # which goes first rotates
            for name in names:
                times[name].append(_timed(*run, stores[name]))
        us = {name: statistics.median(t) for name, t in times.items()}
        ratio = statistics.median(s / f for s, f in zip(times["search"], times["feedback"]))
        print(
            json.dumps(
                {
                    "tokens_per_call": tokens,
                    **{f"us_per_token_layer_{name}": round(t, 3) for name, t in us.items()},
                    "added_us_search_over_plain": round(us["search"] - us["plain"], 3),
                    "median_ratio_search_over_feedback": round(ratio, 2),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
