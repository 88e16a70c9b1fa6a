"""`ProcessSupervisor`: the life of a set of spawned child processes, each with a pipe to it.

- spawn: each child starts in `lifeline.run_tied`, tied to this process from its first
  instruction (it dies with it at any moment of its life);
- answers: `expect(kind)` waits for every child's next message, watching their sentinels beside
  the pipes: a death, an error message, a wrong answer or silence past the bound fails at once,
  naming the child (`ChildFailed`);
- deaths between answers: a watch thread waits on the sentinels and reports the first death;
- stop: the children are asked to exit (the caller's way) and joined for a grace, then killed.

It knows nothing of what the children do: the `mp` executor's ranks run on it. The `serve -dp`
launchers (`router/launcher.py`, `router/offline.py`) still manage their replicas' processes
themselves (they restart replicas and speak HTTP, not pipes); they are the next users to move
onto it.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import connection, get_context

from pagedllm.executor.lifeline import Tie, run_tied


class ChildFailed(Exception):
    """A child died, failed, answered wrongly or kept silent (`reason` names it)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


class ProcessSupervisor:
    """Children 1..n (index 0 is this process), labelled `label(index)` in every reason, started
    by `context` (a multiprocessing context; spawn by default)."""

    def __init__(self, label: Callable[[int], str], name: str, context=None) -> None:
        self.label, self.name = label, name
        self.procs: list = []
        self.conns: list = []
        self._context = context if context is not None else get_context("spawn")
        self._watcher: threading.Thread | None = None
        self._stop_watch: tuple[int, int] | None = None  # the watch thread's wake-up pipe

    def spawn(self, tie: Tie, target: Callable, args: tuple) -> None:
        """Start child `len(procs) + 1`: `target(*args, tie, conn)` in a spawned process, tied
        by `tie` (`lifeline.run_tied`; the target is unpickled, importing what it needs, only
        after the tie holds)."""
        index = len(self.procs) + 1
        ours, theirs = self._context.Pipe()
        proc = self._context.Process(
            target=run_tied,
            args=(tie, pickle.dumps((target, args)), theirs),
            name=f"{self.name}{index}",
            daemon=True,
        )
        proc.start()
        theirs.close()  # so the child's death reads as EOF here
        self.procs.append(proc)
        self.conns.append(ours)

    @property
    def sentinels(self) -> dict[int, int]:
        """Process sentinel -> child index."""
        return {proc.sentinel: index for index, proc in enumerate(self.procs, start=1)}

    def death(self, index: int) -> str:
        """Why child `index` is gone (after a moment for its exit status to arrive)."""
        proc = self.procs[index - 1]
        proc.join(timeout=1.0)
        return f"{self.label(index)} (pid {proc.pid}) died (exit code {proc.exitcode})"

    def first_death(self, timeout_s: float) -> ChildFailed | None:
        """The failure of a child that died within `timeout_s` (waited), else None."""
        sentinels = self.sentinels
        for sentinel in connection.wait(list(sentinels), timeout=timeout_s):
            return ChildFailed(sentinels[sentinel], self.death(sentinels[sentinel]))
        return None

    def check_alive(self) -> None:
        """ChildFailed naming the first child that is not running."""
        for index, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise ChildFailed(index, self.death(index))

    def send(self, message) -> None:
        """`message` down every child's pipe."""
        for index, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except OSError as exc:
                raise ChildFailed(index, f"{self.label(index)} is unreachable ({exc})") from None

    def expect(self, kind: str, timeout_s: float, bound: str, wait_s: float | None = None) -> None:
        """Every child's next answer, which must be `(kind,)`: a death, an `("error", text)`
        answer or silence for `timeout_s` (named `bound`; or `wait_s` in all, when given) raises
        ChildFailed."""
        pending = dict(enumerate(self.conns, start=1))
        sentinels = self.sentinels
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while pending:
            left = timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([*pending.values(), *sentinels], timeout=left)
            if not ready:
                index = min(pending)
                reason = f"{self.label(index)} did not answer within {bound} ({timeout_s:g}s)"
                raise ChildFailed(index, reason)
            for index, conn in list(pending.items()):
                if conn in ready:
                    self._answer(index, conn, kind)
                    del pending[index]
            for sentinel, index in sentinels.items():
                if sentinel in ready and index in pending:
                    raise ChildFailed(index, self.death(index))

    def _answer(self, index: int, conn, kind: str) -> None:
        try:
            answer = conn.recv()
        except (EOFError, OSError):
            raise ChildFailed(index, self.death(index)) from None
        if answer[0] == "error":
            raise ChildFailed(index, f"{self.label(index)} failed:\n{answer[1]}")
        if answer[0] != kind:
            reason = f"{self.label(index)} answered {answer[0]!r}, expected {kind!r}"
            raise ChildFailed(index, reason)

    # ---- the watch thread -----------------------------------------------------------------------

    def watch(self, owner, on_death: Callable) -> None:
        """Start the thread that calls `on_death(owner, reason)` when a child dies (once, for the
        first). `owner` is held weakly: dropping it still lets it shut down."""
        self._stop_watch = os.pipe()
        self._watcher = threading.Thread(
            target=_watch,
            args=(weakref.ref(owner), on_death, self, self._stop_watch[0]),
            name=f"{self.name}-watch",
            daemon=True,
        )
        self._watcher.start()

    def end_watch(self) -> None:
        """Stop the watch thread (before the children are stopped: their exits are no deaths)."""
        if self._stop_watch is None:
            return
        wake, self._stop_watch = self._stop_watch, None
        os.close(wake[1])  # the thread reads EOF and returns
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        os.close(wake[0])

    # ---- stop -----------------------------------------------------------------------------------

    def stop(self, grace_s: float | None) -> None:
        """Join every child for `grace_s` (None: none, they are killed at once; a hung one may
        never exit), kill the ones still running, close the pipes. Idempotent."""
        self.end_watch()
        for proc in self.procs:
            if grace_s is not None:
                proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def _watch(ref: weakref.ref, on_death: Callable, supervisor: ProcessSupervisor, stop_fd: int):
    """The watch thread: waits for a child's death (its sentinel) or for `stop_fd`'s EOF."""
    sentinels = supervisor.sentinels
    ready = connection.wait([*sentinels, stop_fd])
    dead = sorted(sentinels[sentinel] for sentinel in ready if sentinel in sentinels)
    owner = ref()
    if owner is None or stop_fd in ready or not dead:
        return
    on_death(owner, supervisor.death(dead[0]))
