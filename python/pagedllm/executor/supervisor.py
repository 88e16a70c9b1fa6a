"""`ProcessSupervisor`: the life of a set of spawned child processes, each with a pipe to it.

- spawn: each child starts in `lifeline.run_tied`, tied to this process from its first
  instruction (it dies with it at any moment of its life);
- answers: `expect(kind)` waits for every child's next message, watching their sentinels beside
  the pipes: a death, an error message, a wrong answer or silence past the bound fails at once,
  naming the child (`ChildFailed`);
- deaths between answers: a watch thread waits on the sentinels and reports the first death;
- restart: a dead child is spawned again in its place (`respawn`), tied anew;
- stop: the children are asked to exit (the caller's way) and joined for a grace, then sent
  SIGTERM (when the caller gives that a grace too), then killed;
- clean-up: the shared-memory names a child made and had not unlinked when it died (named
  with its pid: `distributed/shm_names.py`; a replica engine killed in the moment between
  creating its all-reduce segment and its ranks mapping it) are removed once it is reaped.

It knows nothing of what the children do: the `mp` executor's ranks, the `serve -dp` replicas
(`router/launcher.py`: they answer over HTTP, their pipe is unused) and the replicas of
`LLM(data_parallel_size=N)` (`router/offline.py`) run on it.

`RayPlacement` is the same for Ray actors: Ray joined (a running cluster) or started (and then
stopped), one placement group placed within a bound, actors per bundle, all released at once;
the `ray` executor's ranks and the Ray `serve -dp` replicas run on it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import connection, get_context

from pagedllm.distributed.shm_names import remove_segments_of
from pagedllm.executor.errors import WorkerStartupError
from pagedllm.executor.lifeline import Tie, run_tied


class ChildFailed(Exception):
    """A child died, failed, answered wrongly or kept silent (`reason` names it; `silent`: it
    is alive but did not answer within the bound)."""

    def __init__(self, index: int, reason: str, silent: bool = False) -> None:
        super().__init__(reason)
        self.index, self.reason, self.silent = index, reason, silent


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
        proc, conn = self._start(len(self.procs) + 1, tie, target, args)
        self.procs.append(proc)
        self.conns.append(conn)

    def respawn(self, index: int, tie: Tie, target: Callable, args: tuple) -> None:
        """Start child `index` again (it died: what is left of it is reaped) in its place."""
        old = self.procs[index - 1]
        if old.is_alive():
            old.kill()
        old.join()
        remove_segments_of(old.pid)
        self.conns[index - 1].close()
        self.procs[index - 1], self.conns[index - 1] = self._start(index, tie, target, args)

    def _start(self, index: int, tie: Tie, target: Callable, args: tuple):
        ours, theirs = self._context.Pipe()
        proc = self._context.Process(
            target=run_tied,
            args=(tie, pickle.dumps((target, args)), theirs),
            name=f"{self.name}{index}",
            daemon=True,
        )
        proc.start()
        theirs.close()  # so the child's death reads as EOF here
        return proc, ours

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

    def send(self, message, indices=None) -> None:
        """`message` down the pipe of each child in `indices` (all by default)."""
        for index in indices or range(1, len(self.conns) + 1):
            try:
                self.conns[index - 1].send(message)
            except OSError as exc:
                if not self.procs[index - 1].is_alive():
                    raise ChildFailed(index, self.death(index)) from None
                raise ChildFailed(index, f"{self.label(index)} is unreachable ({exc})") from None

    def expect(self, kind: str, timeout_s: float, bound: str, wait_s: float | None = None) -> None:
        """Every child's next answer, which must be `(kind,)`: a death, an `("error", text)`
        answer or silence for `timeout_s` (named `bound`; or `wait_s` in all, when given) raises
        ChildFailed."""

        def check(index: int, answer: tuple) -> None:
            if answer[0] == "error":
                raise ChildFailed(index, f"{self.label(index)} failed:\n{answer[1]}")
            if answer[0] != kind:
                reason = f"{self.label(index)} answered {answer[0]!r}, expected {kind!r}"
                raise ChildFailed(index, reason)

        self.receive(range(1, len(self.conns) + 1), check, timeout_s, bound, wait_s)

    def receive(
        self,
        indices,
        on_answer: Callable[[int, tuple], None],
        timeout_s: float | None,
        bound: str,
        wait_s: float | None = None,
    ) -> None:
        """The next answer of each child in `indices`, handed to `on_answer(index, answer)` as it
        comes (which may raise): a death, or silence for `timeout_s` (None: no bound; named
        `bound`; or `wait_s` in all, when given) raises ChildFailed."""
        pending = {index: self.conns[index - 1] for index in indices}
        sentinels = {s: i for s, i in self.sentinels.items() if i in pending}
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while pending:
            left = timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([*pending.values(), *sentinels], timeout=left)
            if not ready:
                index = min(pending)
                reason = f"{self.label(index)} did not answer within {bound} ({timeout_s:g}s)"
                raise ChildFailed(index, reason, silent=True)
            for index, conn in list(pending.items()):
                if conn in ready:
                    del pending[index]
                    on_answer(index, self._answer(index, conn))
            for sentinel, index in sentinels.items():
                if sentinel in ready and index in pending:
                    raise ChildFailed(index, self.death(index))

    def _answer(self, index: int, conn) -> tuple:
        try:
            return conn.recv()
        except (EOFError, OSError):
            raise ChildFailed(index, self.death(index)) from None

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

    def terminate(self) -> None:
        """SIGTERM to every child still running (a server's way to be asked to exit)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()

    def stop(self, grace_s: float | None, terminate_s: float | None = None) -> None:
        """Join the children for `grace_s` in all (None: none, they are killed at once; a hung
        one may never exit), then, with `terminate_s`, SIGTERM the ones still running and join
        them for that long; kill what still runs, close the pipes. Idempotent."""
        self.end_watch()
        for wait_s, signal_first in ((grace_s, False), (terminate_s, True)):
            if wait_s is None:
                continue
            if signal_first:
                self.terminate()
            deadline = time.monotonic() + wait_s
            for proc in self.procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
            remove_segments_of(proc.pid)
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


class RayPlacement:
    """Ray and one placement group for a set of actors, released in one call.

    Ray is joined where it runs (`ray start`, RAY_ADDRESS, or `ray.init` by the caller) and
    started otherwise, and then stopped by `release`. `place` asks for the group, which must be
    placed within a bound, else WorkerStartupError naming what it was for and the cluster's free
    resources. `start(bundle, cls, num_cpus)` runs one actor of `cls` in a bundle (the bundle's
    previous actor killed); `release()` kills every actor, removes the group and stops a Ray it
    started. Idempotent. Ray is imported only here (and by the callers that use it)."""

    def __init__(self) -> None:
        import ray

        self.ray = ray
        self.actors: dict[int, object] = {}  # bundle -> actor
        self.group = None
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init(include_dashboard=False, logging_level="warning")

    def place(self, bundles: list[dict], strategy: str, what: str, timeout_s: float) -> None:
        """The placement group of `bundles` (`strategy`: PACK, SPREAD, ...), for `what`; the
        caller releases this placement when it raises."""
        from ray.util.placement_group import placement_group

        self.group = placement_group(bundles, strategy=strategy)
        try:
            self.ray.get(self.group.ready(), timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise WorkerStartupError(
                f"{what}: the Ray cluster could not place {len(bundles)} bundles of "
                f"{_bundle_text(bundles)} within {timeout_s:g}s; available: "
                f"{self.ray.available_resources()}"
            ) from None

    def start(self, bundle: int, cls, num_cpus: float):
        """A new actor of `cls` (a plain class: made a Ray actor here, never restarted by Ray)
        in `bundle`, in place of the one there before (killed)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.kill(bundle)
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)
        remote = self.ray.remote(num_cpus=num_cpus, max_restarts=0)(cls)
        self.actors[bundle] = remote.options(scheduling_strategy=strategy).remote()
        return self.actors[bundle]

    def kill(self, bundle: int) -> None:
        """Kill the actor in `bundle`, if any (one already dead included)."""
        actor = self.actors.pop(bundle, None)
        if actor is not None:
            with contextlib.suppress(Exception):  # already dead
                self.ray.kill(actor, no_restart=True)

    def release(self) -> None:
        """Kill the actors, remove the group, stop Ray if it was started here. Idempotent."""
        for bundle in list(self.actors):
            self.kill(bundle)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # removed already (Ray stopped meanwhile)
                remove_placement_group(self.group)
            self.group = None
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self.owns_ray = False


def _bundle_text(bundles: list[dict]) -> str:
    """'1 CPU' for a group's bundles (the largest CPU count of them)."""
    cpus = max(bundle.get("CPU", 0) for bundle in bundles)
    return f"{cpus:g} CPU"
