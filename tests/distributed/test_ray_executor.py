"""Tensor parallelism through the `ray` launcher on a local Ray cluster (2 CPUs): the greedy
tokens of one rank, a killed actor failing the step naming its rank, and shutdown leaving no
actor or placement group. Skipped only where Ray is not installed."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pagedllm
from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.multiproc import EngineDeadError
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.worker import StepMessage

from engine_util import greedy_tokens
from model_factory import save_tiny_checkpoint

ray = pytest.importorskip("ray")

# sharing a 32-token prefix (prefix-cache hits), longer than the token budget (chunked
# prefill), more than the cache holds at once (swap preemption: block swaps go to the actor)
PREFIX = list(range(40, 72))
PROMPTS = [PREFIX + [100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(5)]
KNOBS = dict(
    device="cpu",
    cpu_threads=1,
    max_model_len=96,
    num_gpu_blocks=14,
    max_num_batched_tokens=24,
    swap_space=0.01,
    enable_prefix_caching=True,
    preemption_mode="swap",
)


@pytest.fixture(scope="module")
def cluster():
    # the actors import pagedllm from where this process does (a source checkout included)
    source = str(Path(pagedllm.__file__).parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="warning",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def _engine(folder, tp: int, **knobs) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=str(folder),
            tensor_parallel_size=tp,
            distributed_executor_backend="ray",
            **KNOBS,
            **knobs,
        )
    )


def _group_state(group) -> str:
    return ray.util.placement_group_table(group)["state"]


def test_two_ray_ranks_generate_the_greedy_tokens_of_one(cluster, folder):
    one = _engine(folder, 1)
    expected = greedy_tokens(one, PROMPTS, 24)
    engine = _engine(folder, 2)
    try:
        assert type(engine.executor).__name__ == "RayExecutor"
        assert greedy_tokens(engine, PROMPTS, 24) == expected
        stats = engine.get_stats()
        assert stats["prefix_cache_hits"] > 0
        assert stats["num_preemptions_swap"] > 0
    finally:
        engine.shutdown()


def test_two_ray_ranks_calibrate_an_int8_cache_together_and_match_one(cluster, folder):
    # the calibration forward's collectives need both ranks while rank 0 builds its cache
    one = _engine(folder, 1, kv_cache_dtype="int8")
    expected = greedy_tokens(one, PROMPTS, 24)
    engine = _engine(folder, 2, kv_cache_dtype="int8")
    try:
        assert engine.get_stats()["kv_key_calibration"] != "off"
        assert greedy_tokens(engine, PROMPTS, 24) == expected
    finally:
        engine.shutdown()


def test_a_killed_ray_actor_fails_the_step_naming_its_rank(cluster, folder):
    engine = _engine(folder, 2, tp_step_timeout=20.0)
    executor = engine.executor
    try:
        engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=50))
        engine.step()
        (pid,) = executor.pids()
        group = executor.group
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 20.0
        # dead for good, and its placement group is gone with it
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.step()
        assert executor.actors == []
        assert _group_state(group) == "REMOVED"
    finally:
        engine.shutdown()


def test_shutdown_kills_the_actors_and_removes_the_placement_group(cluster, folder):
    engine = _engine(folder, 2)
    executor = engine.executor
    (actor,) = executor.actors
    group = executor.group
    engine.shutdown()
    assert _group_state(group) == "REMOVED"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.pid.remote(), timeout=30)
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.broadcast_step(StepMessage([], None, None))


def _cli_generate(folder, *flags: str) -> str:
    cmd = [sys.executable, "-m", "pagedllm.cli", "generate", "--model", str(folder)]
    cmd += ["--device", "cpu", "--cpu-threads", "1", "--max-tokens", "8", "--temperature", "0"]
    cmd += ["--no-progress", *flags, "hello world"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[0]


def test_the_cli_with_no_cluster_running_starts_ray_and_matches_one_rank(folder):
    # no `cluster` fixture: the engine starts (and at exit stops) a local Ray itself
    ray_line = _cli_generate(folder, "-tp", "2", "--distributed-executor-backend", "ray")
    assert ray_line == _cli_generate(folder)


def test_dropping_the_llm_kills_its_actors_and_removes_the_group(cluster, folder):
    llm = LLM(str(folder), tensor_parallel_size=2, distributed_executor_backend="ray", **KNOBS)
    executor = llm.llm_engine.executor
    (actor,) = executor.actors
    group = executor.group
    del llm, executor
    gc.collect()
    assert _group_state(group) == "REMOVED"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.pid.remote(), timeout=30)


def test_a_cluster_too_small_for_the_ranks_fails_the_start_naming_it(cluster, folder, monkeypatch):
    from pagedllm.executor import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 3.0)
    before = set(ray.util.placement_group_table())
    with pytest.raises(RuntimeError, match="could not place 4 bundles of 1 CPU"):
        _engine(folder, 4)
    # the group it asked for is removed, nothing else was started
    created = set(ray.util.placement_group_table()) - before
    assert [ray.util.placement_group_table()[g]["state"] for g in created] == ["REMOVED"]
    assert not torch.distributed.is_initialized()
