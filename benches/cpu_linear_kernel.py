"""The CPU linear kernel (`kernels/cpu_linear.py`, Rust panels) against oneDNN's matmul over a
weight packed once and `F.linear`, on the 56M Llama's shapes, one thread, thread CPU time
(`time.thread_time`), medians of calls alternated between the three. The weight's bytes over
the time give GB/s (what bounds 1-16 rows), set against the machine's single-core read
bandwidth measured first (a float32 sum over 256 MB); 2 * rows * N * K over the time gives
GFLOP/s (what bounds prefill chunks).

    python benches/cpu_linear_kernel.py [--rows 1 4 16 64 256 1024] [--dtype bfloat16]
        [--repeats 15] [--threads 1]

`--isa-ab avx2 avx512` compares the kernel at two ISA levels instead (`PAGEDLLM_CPU_ISA`, one
process per level, which is how the level is decided): the processes run alternately for
`--rounds` rounds, each timing every shape (`--isa-shapes`, SmolLM2-135M's and a 2048-wide
model's) at every row count; the table gives each level's median time and the median of the
rounds' time ratios (first level / second level: above 1, the second is faster).

    python benches/cpu_linear_kernel.py --isa-ab avx2 avx512 [--rows 1 4 8 128 512]
        [--dtype bfloat16] [--rounds 5] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from pagedllm import _core
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


# the ISA comparison's shapes: (name, out_features, in_features)
ISA_SHAPES = [
    ("smollm2 gate_up", 3072, 576),
    ("smollm2 down", 576, 1536),
    ("2048-wide gate_up", 16384, 2048),
    ("2048-wide down", 2048, 8192),
]


def time_kernel(shapes, rows_list, dtype, repeats) -> dict[str, float]:
    """Median thread-CPU ms of the packed kernel per `shape|rows` (this process's ISA level),
    over `repeats` calls or fewer where they would take more than ~0.5 s."""
    ms = {}
    with torch.inference_mode():
        for name, n, k in shapes:
            weight = torch.randn(n, k).to(dtype)
            packed = cpu_linear.pack(weight)
            for rows in rows_list:
                x = torch.randn(rows, k).to(dtype)
                t = time.thread_time()
                cpu_linear.linear(x, weight, None, packed)  # warm
                # at most ~0.5 s of calls per entry (prefill-sized calls take long), at least 3
                calls = max(3, min(repeats, int(0.5 / max(time.thread_time() - t, 1e-6))))
                times = []
                for _ in range(calls):
                    t = time.thread_time()
                    cpu_linear.linear(x, weight, None, packed)
                    times.append(time.thread_time() - t)
                ms[f"{name} {n}x{k}|{rows}"] = statistics.median(times) * 1e3
    return ms


def isa_child(args) -> int:
    level, _flags = _core.cpu_isa()
    ms = time_kernel(ISA_SHAPES, args.rows, getattr(torch, args.dtype), args.repeats)
    print(json.dumps({"isa": level, "ms": ms}))
    return 0


def isa_ab(args) -> int:
    first, second = args.isa_ab
    runs: dict[str, list[dict[str, float]]] = {first: [], second: []}
    for r in range(args.rounds):
        # alternate which level goes first, so a drift of the machine's load hits both
        for level in (first, second) if r % 2 == 0 else (second, first):
            cmd = [sys.executable, __file__, "--isa-child", "--dtype", args.dtype]
            cmd += ["--repeats", str(args.repeats), "--threads", str(args.threads), "--rows"]
            cmd += [str(rows) for rows in args.rows]
            env = {**os.environ, "PAGEDLLM_CPU_ISA": level}
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            if got["isa"] != level:
                raise SystemExit(f"asked for {level}, the process ran at {got['isa']}")
            runs[level].append(got["ms"])
    flags = " ".join(_core.cpu_isa()[1])
    print(
        f"{args.dtype}, {args.threads} thread(s), {args.rounds} alternated rounds; flags: {flags}"
    )
    print(f"| shape | rows | {first} ms | {second} ms | {first} / {second} (median of rounds) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key in runs[first][0]:
        shape, rows = key.split("|")
        a = [run[key] for run in runs[first]]
        b = [run[key] for run in runs[second]]
        ratio = statistics.median(x / y for x, y in zip(a, b))
        print(
            f"| {shape} | {rows} | {statistics.median(a):.3f} | {statistics.median(b):.3f} "
            f"| {ratio:.2f} |"
        )
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch's (and so the kernel's) threads")
    p.add_argument("--isa-ab", nargs=2, metavar="LEVEL", help="compare two ISA levels")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds of --isa-ab")
    p.add_argument("--isa-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa_child:
        return isa_child(args)
    if args.isa_ab:
        return isa_ab(args)
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
