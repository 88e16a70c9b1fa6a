"""Step faults: what the engine does when a step fails after it was scheduled.

- The whole step fails (building inputs, the forward, batched sampling with no request to
  blame): `roll_back` takes it back with `Scheduler.discard_step`, so its requests are
  recomputed by later steps; a request that was part of `max_step_faults` failed steps is
  given up instead (finished as "abort" with the error as `stop_reason`).
- One request's fault (its own sampling rows, or its output processing, raise): only that
  request ends, the same way (`end_request`), and the step goes on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedllm.engine.request import RequestState

logger = logging.getLogger("pagedllm")


def sample_isolating(sample: Callable, step, logits: torch.Tensor):
    """(sampled, {}) normally; when batched sampling raises, (None, {request id: error}) of the
    requests whose own rows fail to sample, or the error itself if none does alone.

    `sample(step, logits, rows=None)` samples every row of `logits`, or only `rows` of them."""
    try:
        return sample(step, logits), {}
    except Exception:
        rows_of: dict[str, list[int]] = {}
        for k, request_id in enumerate(step.sample_request_ids):
            rows_of.setdefault(request_id, []).append(k)
        faulty = {}
        for request_id, rows in rows_of.items():
            try:
                sample(step, logits, rows)
            except Exception as exc:
                faulty[request_id] = exc
        if not faulty:
            raise
        return None, faulty


class StepFaults:
    """Rolls failed steps back and ends the requests a fault belongs to."""

    def __init__(self, scheduler, requests: dict[str, RequestState], max_step_faults: int) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.max_step_faults = max_step_faults

    def roll_back(self, step, touched: dict[str, RequestState], exc: BaseException) -> None:
        """Takes back a step that failed: its requests are recomputed by later steps (given up
        after `max_step_faults`; an interrupt counts against nobody). The requests given up are
        added to `touched`."""
        rolled_back = self.scheduler.discard_step(step)
        counts = isinstance(exc, Exception)
        for request_id in rolled_back:
            request = self.requests[request_id]
            request.num_faults += counts
            if request.num_faults >= self.max_step_faults:
                self.give_up(
                    request,
                    f"gave up after {request.num_faults} failed steps; last "
                    f"error: {type(exc).__name__}: {exc}",
                )
                touched[request_id] = request
        exc.add_note(
            f"pagedllm: step {step.step} was rolled back; {len(rolled_back)} request(s) "
            f"will be recomputed by the next steps (the engine keeps serving)"
        )

    def end_faulty(
        self, step, faulty: dict[str, Exception], touched: dict[str, RequestState]
    ) -> None:
        """Ends the requests whose sampling failed; the rest of the step is recomputed later."""
        self.scheduler.discard_step(step)
        for request_id, exc in faulty.items():
            self.end_request(request_id, "sampling", exc)
            touched[request_id] = self.requests[request_id]

    def end_request(self, request_id: str, stage: str, exc: Exception) -> None:
        """Ends one request because its `stage` ("sampling", "output processing") failed."""
        self.give_up(self.requests[request_id], f"{stage} failed: {type(exc).__name__}: {exc}")
        logger.error(
            "request %r ended: %s failed: %s: %s", request_id, stage, type(exc).__name__, exc
        )

    def give_up(self, request: RequestState, reason: str) -> None:
        self.scheduler.abort_request(request.request_id)
        request.finish_all("abort", reason)
