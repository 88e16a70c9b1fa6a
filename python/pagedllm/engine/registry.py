"""`RequestRegistry`: the engine's live requests, and the one owner of their lifecycle.

A `RequestState` lives here from `add` (the scheduler has queued it) until `release` (its final
output was returned). The engine's parts (output processing, step faults, speculative decoding,
structured output) read requests through the mapping interface (`registry[id]`, `get`, `in`);
it has no item assignment or deletion, so a request is added, ended and dropped only through the
methods below. How a request ends is decided here once: `abort` ends one the scheduler still
holds (aborted there too), `finish` and `finish_seq` apply what the scheduler decided.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from pagedllm.engine.request import RequestState


class RequestRegistry(Mapping[str, RequestState]):
    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler
        self.offload_tier: str | None = None  # RequestMetrics.offload_tier of loaded tokens
        self._requests: dict[str, RequestState] = {}

    def __getitem__(self, request_id: str) -> RequestState:
        return self._requests[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def num_unfinished(self) -> int:
        return sum(not r.finished for r in self._requests.values())

    # ---- lifecycle --------------------------------------------------------------------------

    def add(self, request: RequestState) -> None:
        """A request the scheduler has just queued (its id is new: the engine checked)."""
        self._requests[request.request_id] = request

    def abort(self, request_id: str, stop_reason: str | None = None) -> RequestState:
        """Ends a request the scheduler still holds: aborted there, each of its sequences
        finished with "abort" and `stop_reason` (why: the fault or error that ended it)."""
        request = self._requests[request_id]
        self._scheduler.abort_request(request_id)
        request.finish_all("abort", stop_reason)
        return request

    def finish(self, request_id: str, reason: str, stop_reason: str | None = None) -> RequestState:
        """Ends a request the scheduler has already finished as a whole (one that can never
        fit)."""
        request = self._requests[request_id]
        request.finish_all(reason, stop_reason)
        return request

    def finish_seq(
        self, request_id: str, index: int, reason: str, stop_reason: int | str | None
    ) -> RequestState:
        """Applies the scheduler's finish of one sequence; the request's finish time is set
        when it was its last."""
        request = self._requests[request_id]
        request.seqs[index].finish(reason, stop_reason)
        if request.finished:
            request.metrics.finished_time = time.time()
        return request

    def release(self, request_id: str) -> None:
        """Drops a finished request whose final output was returned."""
        del self._requests[request_id]

    # ---- what happens to a live request -----------------------------------------------------

    def first_scheduled(self, request_id: str, now: float) -> None:
        """Its first step: time in queue, and the prompt tokens the prefix cache held (and
        of those, the ones the offload tier loaded)."""
        request = self._requests[request_id]
        request.metrics.first_scheduled_time = now
        request.metrics.time_in_queue = now - request.metrics.arrival_time
        request.num_cached_tokens = self._scheduler.num_cached_tokens(request_id) or 0
        offloaded = self._scheduler.num_external_tokens(request_id) or 0
        request.metrics.num_offloaded_cached_tokens = offloaded
        request.metrics.offload_tier = self.offload_tier if offloaded else None

    def preempted(self, request_id: str) -> None:
        self._requests[request_id].metrics.num_preemptions += 1

    def attach_matchers(self, request_id: str, matchers: list) -> None:
        """Structured output: its grammar compiled, one matcher per sequence."""
        self._requests[request_id].matchers = matchers
