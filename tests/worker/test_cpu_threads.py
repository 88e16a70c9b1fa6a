"""The CPU thread default: `cpu_threads`, else OMP_NUM_THREADS, else the physical cores."""

from __future__ import annotations

import os

import torch

from pagedllm.worker import cpu_threads


def test_physical_cores_counts_cores_not_hyperthreads(tmp_path, monkeypatch):
    # 4 logical CPUs on 2 cores of one package (2 hyperthreads each)
    for cpu, core in enumerate([0, 0, 1, 1]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(cpu_threads, "_TOPOLOGY", tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_threads.physical_cores() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    assert cpu_threads.physical_cores() == 1


def test_omp_num_threads_is_left_to_torch(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.default_cpu_threads() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads.default_cpu_threads() == cpu_threads.physical_cores()


def test_configure_sets_torch_threads_and_reports_them():
    before = torch.get_num_threads()
    try:
        assert cpu_threads.configure_cpu_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
