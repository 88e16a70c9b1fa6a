"""The CPU paged-attention kernel at two ISA levels (issue 40): `benches/cpu_attention_kv_quant.py`
run in turn under `PAGEDLLM_CPU_ISA=avx2` and at the machine's level (e.g. avx512), round after
round (the level is decided once per process, so the A/B alternates processes; a busy machine
slows both alike over the rounds). Per (batch, context, cache variant): the median over rounds of
each round's time ratio (level / avx2), and, at each level, the median of the quantized caches'
time over the float cache's of the model's dtype (issue 43: int8 over float32, fp8 over bfloat16;
those pairs alternate call by call inside each process).

    python benches/cpu_attention_isa.py --rounds 3 --levels avx2 avx512 -- \
        --batch 1 16 --context 1024 4096 16384 --variants float32 int8 bfloat16 bf16+fp8_e4m3

Arguments after `--` go to `cpu_attention_kv_quant.py` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).with_name("cpu_attention_kv_quant.py")
# quantized variant -> the float variant of the model's dtype it replaces
BASELINE = {
    "int8": "float32",
    "fp8_e4m3": "float32",
    "fp8_e5m2": "float32",
    "bf16+int8": "bfloat16",
    "bf16+fp8_e4m3": "bfloat16",
    "bf16+fp8_e5m2": "bfloat16",
}


def run_once(level: str, bench_args: list[str]) -> dict[tuple[int, int], dict[str, float]]:
    """One process of the kernel bench at `level`: median ms per (batch, context) and variant."""
    env = dict(os.environ, PAGEDLLM_CPU_ISA=level)
    out = subprocess.run(
        [sys.executable, str(BENCH), *bench_args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {(r["batch"], r["context"]): r["median_ms"] for r in rows}


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--levels", nargs=2, default=["avx2", "avx512"], metavar=("BASE", "LEVEL"))
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1 :]
    base, level = args.levels
    runs: dict[str, list[dict]] = {base: [], level: []}
    for r in range(args.rounds):
        # the order flips every round: neither level always runs first
        for name in (base, level) if r % 2 == 0 else (level, base):
            runs[name].append(run_once(name, bench_args))
            print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    for shape in runs[base][0]:
        variants = runs[base][0][shape]
        speed = {
            v: round(
                statistics.median(
                    x[shape][v] / b[shape][v] for b, x in zip(runs[base], runs[level])
                ),
                3,
            )
            for v in variants
        }
        ms = {
            name: {
                v: round(statistics.median(run[shape][v] for run in runs[name]), 3)
                for v in variants
            }
            for name in (base, level)
        }
        quant = {
            name: {
                f"{v}/{BASELINE[v]}": round(
                    statistics.median(
                        run[shape][v] / run[shape][BASELINE[v]] for run in runs[name]
                    ),
                    3,
                )
                for v in variants
                if v in BASELINE and BASELINE[v] in variants
            }
            for name in (base, level)
        }
        summary = {
            "batch": shape[0],
            "context": shape[1],
            "median_ms": ms,
            f"{level}/{base}": speed,
            "quantized/float": quant,
        }
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
