"""Tensor parallelism through the `ray` launcher on a local Ray cluster (2 CPUs): the greedy
tokens of one rank, a killed actor failing the step naming its rank, and shutdown leaving no
actor or placement group. Skipped only where Ray is not installed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import pagedllm
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.multiproc import EngineDeadError
from pagedllm.sampling_params import SamplingParams

from model_factory import save_tiny_checkpoint

ray = pytest.importorskip("ray")

PROMPTS = [list(range(40, 60)), list(range(80, 87)), list(range(120, 150))]
KNOBS = dict(device="cpu", cpu_threads=1, max_model_len=96, num_gpu_blocks=32)


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


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(len(PROMPTS))]


def _group_state(group) -> str:
    return ray.util.placement_group_table(group)["state"]


def test_two_ray_ranks_generate_the_greedy_tokens_of_one(cluster, folder):
    one = _engine(folder, 1)
    expected = _greedy(one)
    engine = _engine(folder, 2)
    try:
        assert type(engine.executor).__name__ == "RayExecutor"
        assert _greedy(engine) == expected
    finally:
        engine.shutdown()


def test_a_killed_ray_actor_fails_the_step_naming_its_rank(cluster, folder):
    engine = _engine(folder, 2, tp_step_timeout=20.0)
    executor = engine.executor
    try:
        engine.add_request("a", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(max_tokens=60))
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
        executor.step([], None, None)
