"""One failure vocabulary (executor/errors.py): every module that raises or catches an engine's,
a rank's or a replica's death uses the same classes."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints import async_engine
from pagedllm.executor import errors, multiproc
from pagedllm.router import launcher, offline


def test_the_server_and_the_executors_share_one_engine_dead_error():
    assert async_engine.EngineDeadError is errors.EngineDeadError
    assert multiproc.EngineDeadError is errors.EngineDeadError


def test_a_rank_or_replica_death_is_an_engine_death():
    assert issubclass(errors.RankDiedError, errors.EngineDeadError)
    assert offline.ReplicaDiedError is errors.ReplicaDiedError
    assert issubclass(errors.ReplicaDiedError, errors.EngineDeadError)


def test_replicas_that_never_come_up_are_a_startup_error(monkeypatch):
    monkeypatch.setattr(launcher, "START_TIMEOUT_S", 0.0)
    with pytest.raises(errors.WorkerStartupError, match=r"replicas \[0\] did not start"):
        launcher.wait_healthy(["http://127.0.0.1:9"], lambda: None)


class _ActorDied(Exception):
    pass


def test_a_replica_that_ends_during_start_up_is_one_error_class_under_mp_and_ray():
    from types import SimpleNamespace

    from pagedllm.router import ray_launcher

    dead_process = SimpleNamespace(is_alive=lambda: False, exitcode=3)
    with pytest.raises(errors.ReplicaDiedError, match="replica 0 exited during start-up"):
        launcher._check_processes([dead_process])

    def get(ref):
        raise _ActorDied("the actor died")

    ray = SimpleNamespace(
        wait=lambda refs, num_returns, timeout: (refs, []),
        get=get,
        exceptions=SimpleNamespace(RayError=_ActorDied),
    )
    with pytest.raises(errors.ReplicaDiedError, match=r"replica 0 \(Ray actor\) ended"):
        ray_launcher._check_actors(ray, ["serve-call"])
