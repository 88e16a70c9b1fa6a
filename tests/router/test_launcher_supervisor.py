"""`serve -dp` restarts a replica that dies while the router runs: after a back-off that doubles
for each death in a row (capped, forgiven once it stayed up), and again when a restart fails."""

from __future__ import annotations

import threading

import pytest

from pagedllm.router import launcher


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(launcher, "RESTART_FIRST_S", 0.01)
    monkeypatch.setattr(launcher, "RESTART_MAX_S", 0.04)


def test_a_dead_replica_is_restarted(quick):
    alive = [True, False]
    restarted = threading.Event()

    def restart(rank: int) -> None:
        alive[rank] = True
        restarted.set()

    def dead() -> list[tuple[int, str]]:
        return [(rank, "exited") for rank, up in enumerate(alive) if not up]

    with launcher.Supervisor(2, dead, restart, poll_s=0.01):
        assert restarted.wait(5)
    assert alive == [True, True]


def test_a_failed_restart_is_tried_again(quick):
    tries = []
    done = threading.Event()

    def restart(rank: int) -> None:
        tries.append(rank)
        if len(tries) == 1:
            raise OSError("port taken")
        done.set()

    def dead() -> list[tuple[int, str]]:
        return [] if done.is_set() else [(0, "exited")]

    with launcher.Supervisor(1, dead, restart, poll_s=0.01):
        assert done.wait(5)
    assert tries == [0, 0]


def test_the_back_off_doubles_for_deaths_in_a_row_up_to_its_cap(monkeypatch):
    monkeypatch.setattr(launcher, "RESTART_FIRST_S", 1.0)
    monkeypatch.setattr(launcher, "RESTART_MAX_S", 4.0)
    clock = [100.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock[0])
    supervisor = launcher.Supervisor(1, list, lambda rank: None)
    delays = []
    for _ in range(4):
        supervisor._schedule(0, "exited")
        delays.append(supervisor._due.pop(0) - clock[0])
        supervisor._started[0] = clock[0]  # restarted, died again at once
    assert delays == [1.0, 2.0, 4.0, 4.0]
    clock[0] += launcher.RESTART_RESET_S  # up long enough: forgiven
    supervisor._schedule(0, "exited")
    assert supervisor._due[0] - clock[0] == 1.0
