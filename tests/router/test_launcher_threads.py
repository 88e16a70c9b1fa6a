"""A data-parallel replica's CPU threads: the given count, else the engine's own default for
the replicas sharing the machine's cores (`worker.cpu_threads.default_cpu_threads`)."""

from __future__ import annotations

from pagedllm.router.launcher import replica_cpu_threads
from pagedllm.worker import cpu_threads


def _physical_cores(monkeypatch, cores: int) -> None:
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_replicas_share_the_physical_cores_by_the_engines_default(monkeypatch):
    _physical_cores(monkeypatch, 4)
    assert replica_cpu_threads(None, "cpu", 2) == cpu_threads.default_cpu_threads(2) == 2
    assert replica_cpu_threads(None, "auto", 8) == 1  # never below one thread


def test_a_replica_leaves_omp_num_threads_to_torch_as_one_engine_does(monkeypatch):
    _physical_cores(monkeypatch, 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert replica_cpu_threads(None, "cpu", 2) is None


def test_given_threads_and_gpu_replicas_are_left_as_they_are(monkeypatch):
    _physical_cores(monkeypatch, 4)
    assert replica_cpu_threads(3, "cpu", 2) == 3
    assert replica_cpu_threads(None, "cuda", 2) is None
