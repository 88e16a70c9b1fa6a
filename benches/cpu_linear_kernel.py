"""The CPU linear kernel (`kernels/cpu_linear.py`, Rust panels) against oneDNN's matmul over a
weight packed once and `F.linear`, on the 56M Llama's shapes, one thread, thread CPU time
(`time.thread_time`), medians of calls alternated between the three. The weight's bytes over
the time give GB/s (what bounds 1-16 rows), set against the machine's single-core read
bandwidth measured first (a float32 sum over 256 MB); 2 * rows * N * K over the time gives
GFLOP/s (what bounds prefill chunks).

    python benches/cpu_linear_kernel.py [--rows 1 4 16 64 256 1024] [--dtype bfloat16]
        [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_linear

# the 56M Llama (benches/make_llama56m.py): (name, out_features, in_features, per layer)
SHAPES = [
    ("qkv_proj", 1024, 512, 8),
    ("o_proj", 512, 512, 8),
    ("gate_up_proj", 2752, 512, 8),
    ("down_proj", 512, 1376, 8),
    ("lm_head", 32000, 512, 1),
]


def read_bandwidth(repeats: int = 7) -> float:
    """GB/s of one thread summing 256 MB of float32 (the weights' floor per byte)."""
    big = torch.ones(64 * 1024 * 1024)
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        big.sum()
        times.append(time.thread_time() - t)
    return big.numel() * 4 / statistics.median(times) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch's (and so the kernel's) threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bandwidth = read_bandwidth()
    print(
        f"single-core read bandwidth: {bandwidth:.1f} GB/s ({args.dtype}, {args.threads} thread(s))"
    )
    print(
        "| shape | rows | kernel ms | oneDNN packed ms | F.linear ms | kernel GB/s "
        "| kernel GFLOP/s | oneDNN GFLOP/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    totals: dict[int, list[float]] = {}
    with torch.inference_mode():
        for name, n, k, count in SHAPES:
            weight = torch.randn(n, k).to(dtype)
            packed = cpu_linear.pack(weight)
            onednn = None
            if dtype == torch.float32 and torch.backends.mkldnn.is_available():
                onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
            for rows in args.rows:
                x = torch.randn(rows, k).to(dtype)
                calls = {
                    "kernel": lambda x=x, w=weight, p=packed: cpu_linear.linear(x, w, None, p),
                    "F.linear": lambda x=x, w=weight: F.linear(x, w),
                }
                if onednn is not None:
                    calls["onednn"] = lambda x=x, w=onednn: torch.ops.mkldnn._linear_pointwise(
                        x, w, None, "none", [], ""
                    )
                times: dict[str, list[float]] = {key: [] for key in calls}
                for _ in range(args.repeats):
                    for key, call in calls.items():
                        t = time.thread_time()
                        call()
                        times[key].append(time.thread_time() - t)
                ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
                gbs = n * k * weight.element_size() / (ms["kernel"] / 1e3) / 1e9
                flops = 2 * rows * n * k / 1e9
                sums = totals.setdefault(rows, [0.0, 0.0, 0.0])
                sums[0] += count * ms["kernel"]
                sums[1] += count * ms.get("onednn", float("nan"))
                sums[2] += count * ms["F.linear"]
                print(
                    f"| {name} {n}x{k} | {rows} | {ms['kernel']:.3f} | "
                    f"{ms.get('onednn', float('nan')):.3f} | {ms['F.linear']:.3f} | {gbs:.1f} | "
                    f"{flops / ms['kernel'] * 1e3:.1f} | "
                    f"{flops / ms.get('onednn', float('nan')) * 1e3:.1f} |"
                )
    params = sum(n * k * count for _, n, k, count in SHAPES)
    print(f"\nwhole model ({params / 1e6:.1f}M weights, {params * 4 / 1e6:.0f} MB in float32):")
    print(
        "| rows | kernel ms | oneDNN packed ms | F.linear ms | kernel GB/s | kernel GFLOP/s "
        "| kernel / oneDNN time |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    size = 2 if dtype == torch.bfloat16 else 4
    for rows, (ours, onednn, plain) in totals.items():
        gbs = params * size / (ours / 1e3) / 1e9
        gflops = 2 * rows * params / (ours / 1e3) / 1e9
        print(
            f"| {rows} | {ours:.2f} | {onednn:.2f} | {plain:.2f} | {gbs:.1f} | {gflops:.1f} "
            f"| {ours / onednn:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
