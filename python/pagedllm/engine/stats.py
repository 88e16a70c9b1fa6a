"""Engine statistics: the step phase timings (`pagedllm bench`) and the token counters behind
`get_stats()` and the periodic log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm")

STEP_PHASES = ("schedule", "prepare", "forward", "sample", "update")


@dataclass
class StepTimings:
    """Accumulated wall time of the step phases (seconds), for `pagedllm bench`."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    def add(self, marks: tuple[float, ...]) -> None:
        """One step: `marks` are the times at which each phase of `STEP_PHASES` started, then
        the time the last one ended."""
        self.steps += 1
        for name, start, end in zip(STEP_PHASES, marks, marks[1:]):
            setattr(self, name, getattr(self, name) + end - start)

    def mean_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {name: 1e3 * getattr(self, name) / n for name in STEP_PHASES}


class ThroughputStats:
    """Token counters and the periodic log line (tokens/s, queues, KV usage, hits, preemptions).

    `scheduler_stats` returns the scheduler's `get_stats()`; it is only called to log.
    """

    def __init__(
        self,
        interval: float,
        scheduler_stats: Callable[[], Mapping[str, Any]],
        *,
        enabled: bool,
    ) -> None:
        self.interval = interval
        self.enabled = enabled
        self._scheduler_stats = scheduler_stats
        self.started = time.perf_counter()
        self.last_log = self.started
        self.processed_tokens = self.generation_tokens = 0
        self._window_processed = self._window_generation = 0

    def record(self, num_batched_tokens: int, num_generated: int) -> None:
        self.processed_tokens += num_batched_tokens
        self.generation_tokens += num_generated
        self._window_processed += num_batched_tokens
        self._window_generation += num_generated
        now = time.perf_counter()
        if self.enabled and now - self.last_log >= self.interval:
            self._log(now - self.last_log)
            self.last_log = now
            self._window_processed = self._window_generation = 0

    def _log(self, elapsed: float) -> None:
        s = self._scheduler_stats()
        logger.info(
            "processed %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, swapped %d | "
            "KV usage %.1f%% | prefix hit rate %.1f%% | preemptions %d",
            self._window_processed / elapsed,
            self._window_generation / elapsed,
            s["num_running"],
            s["num_waiting"],
            s["num_swapped"],
            100 * s["kv_usage"],
            100 * s["prefix_cache_hit_rate"],
            s["num_preemptions"],
        )

    def totals(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "processed_tokens": self.processed_tokens,
            "generation_tokens": self.generation_tokens,
            "generation_throughput": self.generation_tokens / elapsed,
            "processed_throughput": self.processed_tokens / elapsed,
        }
