"""`--compare-vllm-python` under `-tp N`: vLLM is asked for the same number of ranks, each bound
to a core of its own."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from pagedllm.cli.vllm_compare import VllmProcess, cpu_binding

# a stand-in interpreter: answers the workload line with what it was asked and its environment
ECHO = """#!{python}
import json, os, sys
workload = json.loads(sys.stdin.readline())
reply = {{
    "ready": True,
    "version": "echo",
    "tensor_parallel_size": workload.get("tensor_parallel_size"),
    "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
}}
print("PAGEDLLM-JSON " + json.dumps(reply), flush=True)
sys.stdin.readline()
"""


def _asked(tmp_path, monkeypatch, tp: int) -> dict:
    script = tmp_path / "python"
    script.write_text(ECHO.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    asked = {}
    monkeypatch.setattr(VllmProcess, "_ask", _recording(VllmProcess._ask, asked))
    proc = VllmProcess(
        str(script),
        model="m",
        dtype="float32",
        max_model_len=64,
        seed=0,
        prompts=[[1, 2]],
        max_tokens=[2],
        kv_cache_space_gib=1,
        tensor_parallel_size=tp,
    )
    proc.close()
    return asked


def _recording(ask, into: dict):
    def wrapped(self, message):
        into.update(ask(self, message))
        return into

    return wrapped


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_vllm_is_asked_for_the_ranks_each_bound_to_its_own_core(tmp_path, monkeypatch):
    asked = _asked(tmp_path, monkeypatch, tp=2)
    cores = sorted(os.sched_getaffinity(0))
    assert asked["tensor_parallel_size"] == 2
    assert asked["bind"] == f"{cores[0]}|{cores[1]}"


def test_one_rank_leaves_vllm_its_own_binding(tmp_path, monkeypatch):
    asked = _asked(tmp_path, monkeypatch, tp=1)
    assert asked["tensor_parallel_size"] == 1
    assert asked["bind"] is None


def test_more_ranks_than_cores_are_refused_naming_both():
    ranks = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size={ranks}.*a core per rank"):
        cpu_binding(ranks)
