"""The CPU thread default (`cpu_threads`, else OMP_NUM_THREADS, else the physical cores, shared
by the tensor-parallel ranks) and OpenMP's wait policy."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import torch

import pagedllm
from pagedllm.worker import cpu_threads, model_runner


def _machine(tmp_path, monkeypatch, cores_of_cpus: list[int]) -> None:
    """A machine whose logical CPU i sits on core cores_of_cpus[i] (one package), all allowed."""
    for cpu, core in enumerate(cores_of_cpus):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(cpu_threads, "_TOPOLOGY", tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(len(cores_of_cpus))))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_physical_cores_counts_cores_not_hyperthreads(tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, [0, 0, 1, 1])  # 4 logical CPUs on 2 cores
    assert cpu_threads.physical_cores() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    assert cpu_threads.physical_cores() == 1


def test_omp_num_threads_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.default_cpu_threads() is None


def test_default_is_one_thread_per_physical_core(tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, [0, 1])
    assert cpu_threads.default_cpu_threads() == 2


def test_default_leaves_the_hyperthread_siblings_spare(tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, [0, 0, 1, 1])
    assert cpu_threads.default_cpu_threads() == 2


def test_one_core_gets_one_thread(tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, [0])
    assert cpu_threads.default_cpu_threads() == 1


def test_tensor_parallel_ranks_share_the_usable_cores(tmp_path, monkeypatch):
    _machine(tmp_path, monkeypatch, list(range(9)))  # 9 cores
    assert cpu_threads.default_cpu_threads(ranks=2) == 4
    assert cpu_threads.default_cpu_threads(ranks=3) == 3
    assert cpu_threads.default_cpu_threads(ranks=16) == 1


def test_model_runner_divides_the_default_by_the_models_ranks(monkeypatch):
    seen = []
    monkeypatch.setattr(
        model_runner, "configure_cpu_threads", lambda threads, ranks: seen.append(ranks) or 1
    )
    sharded = SimpleNamespace(tp=SimpleNamespace(size=2))
    model_runner.ModelRunner(sharded, None, torch.device("cpu"))
    model_runner.ModelRunner(SimpleNamespace(), None, torch.device("cpu"))  # not sharded
    assert seen == [2, 1]


def test_configure_sets_torch_threads_and_reports_them():
    before = torch.get_num_threads()
    try:
        assert cpu_threads.configure_cpu_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_passive_wait_policy_unless_one_is_chosen(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    pagedllm._prefer_passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    pagedllm._prefer_passive_openmp()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    pagedllm._prefer_passive_openmp()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_import_pagedllm_sets_the_wait_policy_before_torch_loads():
    code = (
        "import sys, os, pagedllm; assert 'torch' not in sys.modules; "
        "print(os.environ['OMP_WAIT_POLICY'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "PASSIVE"
