"""Helpers shared by the scheduler tests: build a scheduler, run one step with fake samples."""

from __future__ import annotations

import numpy as np

from pagedllm._core import Scheduler
from pagedllm.config import SCHEDULING_STRATEGIES

STRATEGIES = list(SCHEDULING_STRATEGIES)


def make(**kw) -> Scheduler:
    """A scheduler with test defaults: block size 4, no watermark, prefix caching on."""
    kw.setdefault("block_size", 4)
    kw.setdefault("watermark", 0.0)
    return Scheduler(**kw)


def prompt(tag: int, length: int) -> list[int]:
    """`length` token ids unique to `tag` (no accidental prefix-cache hits between tags)."""
    return [1000 * (tag + 1) + i for i in range(length)]


def step(s: Scheduler, token: int = 7):
    """One `schedule()` + `update_from_output` where every sample is `token`.

    Returns (output, finished sequences); checks the scheduler's invariants after it."""
    out = s.schedule()
    finished = s.update_from_output(out, np.full(out.num_samples, token, dtype=np.int64))
    s.check_invariants()
    return out, finished


def all_blocks_free(s: Scheduler) -> bool:
    st = s.get_stats()
    return (
        st["num_free_gpu_blocks"] == st["num_gpu_blocks"]
        and st["num_free_cpu_blocks"] == st["num_cpu_blocks"]
    )
