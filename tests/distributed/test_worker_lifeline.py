"""A spawned worker dies with its engine (`executor.lifeline`): before its target is even loaded,
once it holds its shared memory (the kernel's parent-death signal), and when it was spawned from
a thread that ends before the engine (which must not kill it). Stand-in engines and workers: no
model, so each test takes about a second."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import uuid
from multiprocessing import get_context
from pathlib import Path

from pagedllm.executor.lifeline import ORPHAN_EXIT_CODE, Tie, run_tied

CONTEXT = get_context("spawn")
# what "at once" allows on a loaded machine (a worker left orphaned ran on for minutes)
GONE_WITHIN_S = 3.0


def _worker(hold: bool, tie: Tie, held, started) -> None:
    """A stand-in worker: holds its names (arming the death signal) or not, says so, waits."""
    if hold:
        tie.hold()
    started.put(os.getpid())
    held.set()
    threading.Event().wait()


def _spawn_worker(names: tuple[str, ...], hold: bool, held, started) -> None:
    """Spawn the worker and return once it holds (a death signal it armed would now be live)."""
    tie = Tie.to_this_process(orphan_names=names)
    payload = pickle.dumps((_worker, (hold,)))
    CONTEXT.Process(target=run_tied, args=(tie, payload, held, started)).start()
    held.wait(60)


def _engine(names: tuple[str, ...], hold: bool, from_thread: bool, started) -> None:
    """A stand-in engine: spawns one tied worker (from a thread that then ends, if asked) and
    waits to be killed."""
    held = CONTEXT.Event()
    if from_thread:
        spawner = threading.Thread(target=_spawn_worker, args=(names, hold, held, started))
        spawner.start()
        spawner.join()  # the thread that spawned the worker is gone; the engine lives on
        started.put("spawner ended")
    else:
        _spawn_worker(names, hold, held, started)
    threading.Event().wait()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # an orphan's zombie waits for init to reap it: it is gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _wait_gone(pid: int) -> float:
    start = time.monotonic()
    while not _gone(pid):
        assert time.monotonic() - start < GONE_WITHIN_S, f"worker {pid} outlived its engine"
        time.sleep(0.02)
    return time.monotonic() - start


class _Run:
    """A stand-in engine with its worker; both killed at the end whatever happened."""

    def __init__(self, names=(), hold=False, from_thread=False) -> None:
        self.started = CONTEXT.Queue()
        self.engine = CONTEXT.Process(target=_engine, args=(names, hold, from_thread, self.started))
        self.engine.start()
        self.worker = self.started.get(timeout=60)

    def kill_engine(self) -> None:
        os.kill(self.engine.pid, signal.SIGKILL)
        self.engine.join()

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc) -> None:
        for pid in (self.engine.pid, self.worker):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.engine.join()
        self.started.close()


def test_a_worker_exits_at_once_when_its_engine_is_killed_before_it_holds_its_names():
    with _Run(hold=False) as run:
        run.kill_engine()
        _wait_gone(run.worker)


def test_a_worker_that_holds_its_names_is_killed_with_its_engine():
    with _Run(hold=True) as run:
        run.kill_engine()
        _wait_gone(run.worker)


def test_a_worker_whose_engine_died_removes_the_names_it_had_still_to_open():
    name = f"/pagedllm-test-lifeline-{uuid.uuid4().hex}"
    path = Path(f"/dev/shm{name}")
    path.write_bytes(b"ring")
    try:
        with _Run(names=(name,), hold=False) as run:
            run.kill_engine()
            _wait_gone(run.worker)
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_worker_spawned_from_a_thread_that_ends_lives_on_with_its_engine():
    # the parent-death signal follows the spawning *thread*: it must not be armed for this one
    with _Run(hold=True, from_thread=True) as run:
        assert run.started.get(timeout=60) == "spawner ended"
        time.sleep(0.3)
        assert not _gone(run.worker)
        run.kill_engine()  # the watch still ties it to the engine
        _wait_gone(run.worker)


def test_a_worker_whose_engine_is_gone_before_it_starts_exits_without_running_its_target():
    name = f"/pagedllm-test-lifeline-{uuid.uuid4().hex}"
    path = Path(f"/dev/shm{name}")
    path.write_bytes(b"ring")
    started, held = CONTEXT.Queue(), CONTEXT.Event()
    tie = Tie(parent_pid=os.getpid() + 1, death_signal=False, orphan_names=(name,))
    payload = pickle.dumps((_worker, (False,)))
    worker = CONTEXT.Process(target=run_tied, args=(tie, payload, held, started))
    try:
        worker.start()
        worker.join(timeout=60)
        assert worker.exitcode == ORPHAN_EXIT_CODE
        assert started.empty()
        assert not path.exists()
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
        path.unlink(missing_ok=True)
        started.close()
