"""The decode step's fused small ops against the torch ops they replace: thread-CPU us per call,
median of 400, the two alternated call by call in one process (torch with 2 threads), at 1, 8 and
64 rows of the 56M Llama's shapes (hidden 512, intermediate 1376, vocabulary 32000).

    PYTHONPATH=python python benches/decode_ops.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_norm
from pagedllm.kernels.cpu_activation import silu_and_mul
from pagedllm.sampling.ops import argmax_rows

HIDDEN, INTERMEDIATE, VOCAB = 512, 1376, 32000


def _medians(calls: dict, n: int = 400) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(10):
        for call in calls.values():
            call()
    for _ in range(n):
        for name, call in calls.items():
            t = time.thread_time()
            call()
            times[name].append(time.thread_time() - t)
    return {name: sorted(v)[len(v) // 2] * 1e6 for name, v in times.items()}


def _calls(rows: int) -> dict:
    gate_up = torch.randn(rows, 2 * INTERMEDIATE)
    x, residual, weight = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), torch.randn(HIDDEN)
    logits = torch.randn(rows, VOCAB)

    def torch_act():
        gate, up = gate_up.split(INTERMEDIATE, -1)
        return F.silu(gate).mul_(up)

    return {
        "silu*mul torch": torch_act,
        "silu_and_mul": lambda: silu_and_mul(gate_up),
        # both sides copy their inputs once (the fused op writes in place)
        "add_ + rms_norm": lambda: cpu_norm.rms_norm(x.clone().add_(residual), weight, 1e-6),
        "add_rms_norm": lambda: cpu_norm.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6),
        "torch argmax": lambda: logits.argmax(-1),
        "argmax_rows": lambda: argmax_rows(logits),
    }


def main() -> int:
    torch.set_num_threads(2)
    with torch.inference_mode():
        for rows in (1, 8, 64):
            medians = _medians(_calls(rows))
            print(rows, " ".join(f"{k}={v:.1f}" for k, v in medians.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
