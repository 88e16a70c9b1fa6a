"""`ProcessSupervisor` (executor/supervisor.py): tied children with a pipe each; their answers,
deaths, silences and errors, each named; a watch thread for deaths between answers; stop then
kill. Stand-in children (no model): each test spawns one in about a second."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from pagedllm.executor.lifeline import Tie
from pagedllm.executor.supervisor import ChildFailed, ProcessSupervisor


def _answer(kind: str, tie, conn) -> None:
    """Answers `kind`, then waits until its pipe closes."""
    conn.send((kind,))
    with contextlib.suppress(EOFError):
        conn.recv()


def _exit(code: int, tie, conn) -> None:
    os._exit(code)


def _fail(tie, conn) -> None:
    conn.send(("error", "Traceback: boom"))
    threading.Event().wait()


def _hang(tie, conn) -> None:
    threading.Event().wait()


def _die_holding_a_segment(tie, conn) -> None:
    """Creates an all-reduce segment (its name in /dev/shm) and is killed before unlinking it."""
    from pagedllm._core import ShmAllReduce

    segment = ShmAllReduce.create(2, 64, 1.0)
    conn.send((segment.name,))
    os.kill(os.getpid(), signal.SIGKILL)


def _label(index: int) -> str:
    return f"stand-in {index}"


@pytest.fixture
def supervisor():
    children = ProcessSupervisor(_label, "test-child")
    yield children
    children.stop(None)


def _spawn(children: ProcessSupervisor, target, *args) -> None:
    children.spawn(Tie.to_this_process(), target, args)


def test_expect_returns_once_every_child_answered(supervisor):
    _spawn(supervisor, _answer, "ready")
    _spawn(supervisor, _answer, "ready")
    supervisor.expect("ready", 60.0, "the start-up timeout")


def test_a_child_that_dies_fails_expect_naming_it_and_its_exit_code(supervisor):
    _spawn(supervisor, _exit, 3)
    with pytest.raises(ChildFailed, match=r"stand-in 1 \(pid \d+\) died \(exit code 3\)"):
        supervisor.expect("ready", 60.0, "the start-up timeout")


def test_a_silent_child_fails_expect_after_its_bound(supervisor):
    _spawn(supervisor, _hang)
    start = time.monotonic()
    with pytest.raises(ChildFailed, match=r"stand-in 1 did not answer within tp_step_timeout"):
        supervisor.expect("ok", 0.5, "tp_step_timeout")
    assert time.monotonic() - start < 5.0


def test_an_error_answer_fails_expect_with_its_text(supervisor):
    _spawn(supervisor, _fail)
    with pytest.raises(ChildFailed, match="stand-in 1 failed:\nTraceback: boom") as failed:
        supervisor.expect("ok", 60.0, "tp_step_timeout")
    assert failed.value.index == 1


class _Owner:
    def __init__(self) -> None:
        self.deaths: list[str] = []
        self.told = threading.Event()

    def died(self, reason: str) -> None:
        self.deaths.append(reason)
        self.told.set()


def test_the_watch_thread_reports_a_death_between_answers(supervisor):
    owner = _Owner()
    _spawn(supervisor, _exit, 5)
    supervisor.watch(owner, _Owner.died)
    assert owner.told.wait(30)
    assert owner.deaths == [f"stand-in 1 (pid {supervisor.procs[0].pid}) died (exit code 5)"]


def test_stop_kills_a_child_that_does_not_exit_within_the_grace(supervisor):
    _spawn(supervisor, _hang)
    proc = supervisor.procs[0]
    supervisor.stop(0.2)
    assert not proc.is_alive()
    assert supervisor.procs == [] and supervisor.conns == []


def _exit_on_sigterm(code: int, tie, conn) -> None:
    """Exits with `code` on SIGTERM (a server's way to stop), hangs otherwise."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    conn.send(("ready",))
    threading.Event().wait()


def test_stop_with_a_terminate_grace_sends_sigterm_before_killing(supervisor):
    _spawn(supervisor, _exit_on_sigterm, 7)
    supervisor.expect("ready", 60.0, "the start-up timeout")
    proc = supervisor.procs[0]
    supervisor.stop(0.0, terminate_s=30.0)
    assert proc.exitcode == 7


def test_a_dead_child_is_respawned_in_its_place(supervisor):
    _spawn(supervisor, _answer, "ready")
    _spawn(supervisor, _exit, 4)
    dead = supervisor.procs[1]
    dead.join(30)
    supervisor.respawn(2, Tie.to_this_process(), _answer, ("ready",))
    supervisor.expect("ready", 60.0, "the start-up timeout")
    assert supervisor.procs[1] is not dead and all(p.is_alive() for p in supervisor.procs)


def test_receive_hands_each_answer_with_its_payload_to_the_caller(supervisor):
    _spawn(supervisor, _answer, "ok")
    _spawn(supervisor, _answer, "ok")
    got = {}
    supervisor.receive([2], lambda index, answer: got.setdefault(index, answer), 60.0, "bound")
    assert got == {2: ("ok",)}


def test_a_silent_child_is_told_apart_from_a_dead_one(supervisor):
    _spawn(supervisor, _hang)
    with pytest.raises(ChildFailed) as silent:
        supervisor.expect("ok", 0.2, "tp_step_timeout")
    assert silent.value.silent
    supervisor.procs[0].kill()
    with pytest.raises(ChildFailed) as dead:
        supervisor.expect("ok", 60.0, "tp_step_timeout")
    assert not dead.value.silent


def test_a_child_killed_before_unlinking_its_segment_leaves_no_name_once_stopped(supervisor):
    _spawn(supervisor, _die_holding_a_segment)
    (name,) = supervisor.conns[0].recv()
    path = f"/dev/shm/{name.lstrip('/')}"
    supervisor.procs[0].join(10)
    try:
        assert os.path.exists(path)  # what the child left
        supervisor.stop(None)
        assert not os.path.exists(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
