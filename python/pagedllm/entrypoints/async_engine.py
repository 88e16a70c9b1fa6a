"""`AsyncEngine`: the engine behind the server.

One background task owns the `LLMEngine`. Every engine call (add, abort, step, stats) runs in
one worker thread (`asyncio.to_thread`), so the event loop stays responsive while the model runs
and the engine is never touched by two threads at once. While work lasts, that thread steps
back to back (a burst) and hands each step's outputs to the event loop as they come
(`call_soon_threadsafe`): the next step never waits for the event loop to be scheduled, which on
a busy machine cost a scheduling delay per token (vLLM runs its engine core in a process of its
own for the same reason). Requests enter through a lock-guarded inbox; each request gets an
`asyncio.Queue` of its (cumulative) `RequestOutput`s. Other engine work that must not race a
step (an adapter loaded or unloaded while serving) goes through `between_steps`.

A step that raises was already rolled back by the engine (see `engine/faults.py`): the error is
logged and the loop goes on after a back-off (doubling from `BACKOFF_BASE_S` to `BACKOFF_CAP_S`),
so a transient fault is survived. While steps keep failing (`UNHEALTHY_AFTER_FAILURES` in a row,
work still pending) the engine is unhealthy: `/health` fails and new requests get 503; one step
that succeeds, or the engine running out of work, makes it healthy again. `max_failed_steps` failed
steps in a row (no success in between) mean a broken engine: the loop stops, live requests get
503 and `on_dead` is called (the server then exits non-zero, for a supervisor to restart it). A
tensor-parallel rank that died, hung or failed (`RankDiedError`, from the executor; any
`EngineDeadError`) cannot come back: the first such step takes the same way out at once, with
nothing retried; a rank that dies while the engine is idle does too, as soon as the executor
sees it (it wakes the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedllm.engine import LLMEngine
from pagedllm.executor.errors import EngineDeadError, RankDiedError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.server")
T = TypeVar("T")

# a failed step is retried after BACKOFF_BASE_S, doubled per further failure, at most BACKOFF_CAP_S
BACKOFF_BASE_S = 0.01
BACKOFF_CAP_S = 1.0
UNHEALTHY_AFTER_FAILURES = 3
# failed steps in a row after which the engine counts as broken: ~25 s of failing with back-off
MAX_FAILED_STEPS = 30
# one engine turn (a step) running longer than this means a stuck loop: /health fails
STALL_TIMEOUT_S = 120.0


@dataclass
class PendingRequest:
    """A request handed to the engine loop: `added` resolves once the engine took it (or holds
    its validation error); `queue` then receives its outputs."""

    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    added: asyncio.Future
    queue: asyncio.Queue
    num_prompt_tokens: int = 0
    lora_request: Any = None  # a LoRARequest (None: the base model)


@dataclass
class _Live:
    queue: asyncio.Queue
    num_prompt_tokens: int
    started: bool = False  # has it produced a token (left the queue)?


@dataclass
class EngineSnapshot:
    """What the event loop may read of the engine between steps (taken in the engine thread)."""

    stats: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0
    # ids in the scheduler's waiting queue (only while `track_waiting` is set)
    waiting: frozenset[str] = frozenset()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.max_failed_steps = MAX_FAILED_STEPS  # the server sets its --max-failed-steps
        self._turn_started: float | None = None  # monotonic time the running turn began
        self._lock = threading.Lock()
        self._inbox: list[PendingRequest] = []
        self._adding: list[PendingRequest] = []  # taken from the inbox by the running engine turn
        self._aborts: list[str] = []
        # engine calls to run between two steps (`between_steps`), with their futures
        self._calls: list[tuple[Callable[[LLMEngine], Any], asyncio.Future]] = []
        self._live: dict[str, _Live] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.consecutive_failures = 0  # failed steps since the last one that succeeded
        self.failing = False  # steps keep failing and work is pending: unhealthy for now
        self.dead = False  # the loop stopped for good (not by `stop`)
        self.last_error: BaseException | None = None
        self.last_progress = time.monotonic()
        self.snapshot = EngineSnapshot(stats=engine.get_stats(), time=time.time())
        # called in the event loop with each finished RequestOutput (metrics)
        self.on_finished: list = []
        self.on_output: list = []
        # called in the event loop once the loop stopped for good (the server exits)
        self.on_dead: list = []
        # admission control needs to know which requests have not started; off by default
        # because listing the waiting queue costs time every step
        self.track_waiting = False

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name="pagedllm-engine-loop")
        self.engine.on_death(self._rank_died)

    def _rank_died(self, reason: str) -> None:
        """From the executor's watch thread: wake the loop, which then stops (see `_serve`)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                loop.call_soon_threadsafe(wake.set)

    def begin_shutdown(self) -> None:
        """Refuses new requests and aborts the live ones: their streams end with finish reason
        "abort" and stop_reason "the server is shutting down"."""
        self._stopping = True
        with self._lock:
            self._aborts.extend(self._live)
        if self._wake is not None:
            self._wake.set()

    async def stop(self) -> None:
        """Aborts every live request (its stream ends with finish reason "abort") and stops."""
        self.begin_shutdown()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=30)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            except Exception:  # noqa: BLE001 - already logged by the loop
                pass
        # tensor-parallel workers stop with the server (a no-op with one rank)
        await asyncio.to_thread(self.engine.shutdown)

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the engine cannot take requests now (None: it can); /health and `submit` both
        ask this."""
        if self.dead or self._task is None or self._task.done():
            last = f" (last error: {self.last_error!r})" if self.last_error else ""
            return f"the engine loop is not running{last}"
        dead = self.engine.dead_reason  # a tensor-parallel rank died, even between steps
        if dead is not None:
            return f"the engine cannot run steps: {dead}"
        if self.failing:
            return (
                f"the engine is failing ({self.consecutive_failures} failed steps in a row, "
                f"last error: {self.last_error!r}); retry later"
            )
        if self.stalled:
            return "an engine step has been running too long; retry later"
        return None

    @property
    def stalled(self) -> bool:
        """An engine turn has been running for more than `stall_timeout_s`."""
        started = self._turn_started
        return started is not None and time.monotonic() - started > self.stall_timeout_s

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- admission view ---------------------------------------------------------------------

    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) submitted and not started: still in the inbox, or in the
        scheduler's waiting queue without a token computed yet. A request whose (chunked)
        prefill is under way is running, not queued. Needs `track_waiting`."""
        with self._lock:
            pending = self._inbox + self._adding
        waiting = self.snapshot.waiting
        not_started = [
            live
            for request_id, live in list(self._live.items())
            if not live.started and request_id in waiting
        ]
        requests = len(pending) + len(not_started)
        tokens = sum(p.num_prompt_tokens for p in pending)
        tokens += sum(live.num_prompt_tokens for live in not_started)
        return requests, tokens

    # ---- requests ---------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        num_prompt_tokens: int = 0,
        lora_request: Any = None,
    ) -> PendingRequest:
        """Queues a request at once (`queued()` counts it from now on); await its `added` for
        the engine's validation errors (ValueError naming the field). Its `queue` receives the
        (cumulative) outputs, the last one with finished=True. EngineDeadError (503) while the
        engine cannot take requests."""
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        reason = self.unhealthy_reason
        if reason is not None:
            raise EngineDeadError(reason)
        assert self._loop is not None and self._wake is not None
        pending = PendingRequest(
            request_id,
            prompt,
            params,
            priority,
            self._loop.create_future(),
            asyncio.Queue(),
            num_prompt_tokens,
            lora_request,
        )
        with self._lock:
            self._inbox.append(pending)
        self._wake.set()
        return pending

    def abort(self, request_id: str) -> None:
        """Aborts a request (unknown or finished ids are ignored); its blocks are free after the
        next engine step."""
        with self._lock:
            self._aborts.append(request_id)
        if self._wake is not None:
            self._wake.set()

    async def between_steps(self, call: Callable[[LLMEngine], T]) -> T:
        """Runs `call(engine)` in the engine thread between two steps (never during one: the
        requests in flight see the change at a step boundary) and returns its result or raises
        its error. Keep it short: it delays the next step. EngineDeadError once the engine loop
        is gone or stopping."""
        if self._stopping or self.dead or self._task is None or self._task.done():
            raise EngineDeadError("the engine loop is not running")
        assert self._loop is not None and self._wake is not None
        future = self._loop.create_future()
        with self._lock:
            self._calls.append((call, future))
        self._wake.set()
        return await future

    # ---- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._serve()
        except Exception as exc:  # noqa: BLE001 - a bug outside the step: the loop is gone
            logger.exception("the engine loop crashed")
            self.last_error = exc
        if not self._stopping:  # stopped for good while the server runs: never a zombie
            self._die()

    async def _serve(self) -> None:
        """Runs engine turns until stopped (returns) or `max_failed_steps` failures (returns)."""
        assert self._wake is not None
        while True:
            dead = self.engine.dead_reason
            if dead is not None and not self._stopping:
                self.last_error = RankDiedError(dead)  # a rank died while the engine was idle
                return
            with self._lock:
                has_input = bool(self._inbox or self._aborts or self._calls)
            if not has_input and not self._live and self._stopping:
                return
            if not has_input and not self.engine.has_unfinished_requests():
                # nothing left to fail on (its requests were given up): healthy again
                self.failing = False
                self._wake.clear()
                with self._lock:
                    has_input = bool(self._inbox or self._aborts or self._calls)
                if not has_input:
                    self.last_progress = time.monotonic()
                    await self._wake.wait()
                    continue
            try:
                error = await asyncio.to_thread(self._engine_burst)
            finally:
                self._turn_started = None
            # every turn's `_after_turn` ran before this await returned (callbacks run in order)
            self.last_progress = time.monotonic()
            if error is None:
                continue
            self.consecutive_failures += 1
            self.last_error = error
            logger.error("engine step failed (%d in a row): %r", self.consecutive_failures, error)
            if self.consecutive_failures >= self.max_failed_steps or isinstance(
                error, EngineDeadError
            ):
                return
            self.failing = self.consecutive_failures >= UNHEALTHY_AFTER_FAILURES
            await asyncio.sleep(backoff_s(self.consecutive_failures))

    def _engine_burst(self) -> BaseException | None:
        """In the engine thread: turns back to back until no work is left (None) or a step
        fails (its error); each turn's results go to the event loop as soon as it ends."""
        assert self._loop is not None
        while True:
            self._turn_started = time.monotonic()
            added, outputs, error = self._engine_turn()
            self.last_progress = time.monotonic()
            self._loop.call_soon_threadsafe(self._after_turn, added, outputs, error is None)
            if error is not None:
                return error
            with self._lock:
                has_input = bool(self._inbox or self._aborts or self._calls)
            if not has_input and not self.engine.has_unfinished_requests():
                return None

    def _after_turn(self, added: list, outputs: list[RequestOutput], succeeded: bool) -> None:
        """In the event loop, once per engine turn: settle the requests it added, deliver its
        outputs, and count a successful step."""
        for pending, exc in added:
            if pending.added.done():
                continue
            if exc is None:
                self._live[pending.request_id] = _Live(pending.queue, pending.num_prompt_tokens)
                pending.added.set_result(None)
            else:
                pending.added.set_exception(exc)
        with self._lock:
            taken = {id(pending) for pending, _ in added}
            self._adding = [p for p in self._adding if id(p) not in taken]
        for output in outputs:
            self._deliver(output)
        if succeeded:
            if self.consecutive_failures:
                logger.warning(
                    "engine steps succeed again after %d failures", self.consecutive_failures
                )
            self.consecutive_failures = 0
            self.failing = False

    def _engine_turn(self):
        """In the engine thread: take the inbox and aborts, run one step if work exists."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            self._adding += inbox
        for call, future in calls:
            self._settle(future, call)
        added = []
        for pending in inbox:
            try:
                self.engine.add_request(
                    pending.request_id,
                    pending.prompt,
                    pending.params,
                    priority=pending.priority,
                    lora_request=pending.lora_request,
                )
                added.append((pending, None))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                added.append((pending, exc))
        if aborts:
            self.engine.abort_request(aborts)
        outputs: list[RequestOutput] = []
        error = None
        if self.engine.has_unfinished_requests():
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - rolled back by the engine; logged
                error = exc
        self._free_retired_loras()
        waiting = self.engine.scheduler.waiting_ids() if self.track_waiting else ()
        self.snapshot = EngineSnapshot(self.engine.get_stats(), time.time(), frozenset(waiting))
        return added, outputs, error

    def _settle(self, future: asyncio.Future, call: Callable[[LLMEngine], Any]) -> None:
        """In the engine thread: runs `call` and hands its result or error to `future`."""
        try:
            result, error = call(self.engine), None
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            result, error = None, exc
        assert self._loop is not None

        def settle() -> None:
            if future.done():  # the caller went away
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        self._loop.call_soon_threadsafe(settle)

    def _free_retired_loras(self) -> None:
        """In the engine thread, after a step: adapters unloaded while requests still used them
        are freed once those requests finished."""
        lora = getattr(self.engine, "lora", None)
        if lora is None or not lora.retired:
            return
        in_use = {
            state.lora_request.lora_int_id
            for state in self.engine.requests.values()
            if state.lora_request is not None and not state.finished
        }
        lora.free_retired(in_use)

    def _deliver(self, output: RequestOutput) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        if not live.started and (output.finished or any(c.token_ids for c in output.outputs)):
            live.started = True
        if self._stopping and output.finished:
            for completion in output.outputs:
                if completion.finish_reason == "abort" and completion.stop_reason is None:
                    completion.stop_reason = "the server is shutting down"
        live.queue.put_nowait(output)
        for callback in self.on_output:
            callback(output)
        if output.finished:
            del self._live[output.request_id]
            for callback in self.on_finished:
                callback(output)

    def _die(self) -> None:
        """The loop stopped for good: live and pending requests get 503 (EngineDeadError),
        /health fails, and `on_dead` is called so that the process exits."""
        self.dead = True
        logger.error(
            "the engine is broken (%d failed steps in a row; last error: %r): stopping",
            self.consecutive_failures,
            self.last_error,
        )
        error = EngineDeadError(f"the engine failed: {self.last_error!r}")
        for live in self._live.values():
            live.queue.put_nowait(error)
        self._live.clear()
        with self._lock:  # a crashed turn may have left requests it was adding
            pending_requests = self._inbox + self._adding
            self._inbox, self._adding = [], []
            calls, self._calls = self._calls, []
        for _, future in calls:
            if not future.done():
                future.set_exception(error)
        for pending in pending_requests:
            if not pending.added.done():
                pending.added.set_exception(error)
        for callback in self.on_dead:
            callback()


def backoff_s(failures: int) -> float:
    """Seconds to wait after `failures` failed steps in a row before the next try."""
    return min(BACKOFF_BASE_S * 2.0 ** (failures - 1), BACKOFF_CAP_S)
