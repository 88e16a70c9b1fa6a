"""`serve -dp N` (mp) start-up: the launcher waits for every replica's /health, and a replica
that exits first fails the start naming it and its exit status."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.router import launcher


def test_a_replica_that_exits_during_start_up_is_named_with_its_status():
    procs = [
        SimpleNamespace(is_alive=lambda: True, exitcode=None),
        SimpleNamespace(is_alive=lambda: False, exitcode=3),
    ]
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:9"]  # nothing answers there
    with pytest.raises(RuntimeError, match=r"replica 1 exited during start-up \(status 3\)"):
        launcher.wait_healthy(urls, lambda: launcher._check_processes(procs))


def test_replicas_that_never_answer_are_named_after_the_timeout(monkeypatch):
    monkeypatch.setattr(launcher, "START_TIMEOUT_S", 0.0)
    with pytest.raises(RuntimeError, match=r"replicas \[0, 1\] did not start"):
        launcher.wait_healthy(["http://127.0.0.1:9", "http://127.0.0.1:9"], lambda: None)
