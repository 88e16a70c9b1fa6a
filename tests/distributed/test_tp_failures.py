"""A tensor-parallel engine and its workers never outlive each other unnoticed: an engine killed at
any moment takes its workers (and multiprocessing's resource tracker) with it within seconds,
leaving nothing in /dev/shm; a worker that dies while the engine is idle makes the engine dead at
once, before any step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.multiproc import EngineDeadError

from model_factory import save_tiny_checkpoint

KNOBS = dict(device="cpu", cpu_threads=1, max_model_len=96, num_gpu_blocks=14)
# an engine in a process of its own: it says "ready" once started, then idles until killed
ENGINE = (
    "import sys, time\n"
    "from pagedllm import LLM\n"
    f"llm = LLM(sys.argv[1], tensor_parallel_size=2, **{KNOBS!r})\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
# what "at once" allows on a loaded machine (a worker left orphaned ran on for minutes)
GONE_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _is_worker(pid: int) -> bool:
    """A spawned rank (not multiprocessing's resource tracker)."""
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()


def _shm_mapped(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "/dev/shm/" in line}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # an orphan's zombie waits for init to reap it: it is gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while not all(_gone(pid) for pid in pids):
        alive = [pid for pid in pids if not _gone(pid)]
        assert time.monotonic() < deadline, f"{alive} outlived their engine"
        time.sleep(0.05)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_engine_killed_at_start_up_takes_its_workers_and_the_ring_with_it(checkpoint):
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(checkpoint)])
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not any(_is_worker(child) for child in children):
            assert engine.poll() is None and time.monotonic() < deadline, "no worker spawned"
            time.sleep(0.01)
            children = _children(engine.pid)
        ring = _shm_mapped(engine.pid)
        # the worker is still starting (importing torch): the ring's name waits for it
        assert ring and all(os.path.exists(path) for path in ring)
        engine.kill()
        engine.wait()
        _assert_all_gone(children)
        assert not [path for path in ring if os.path.exists(path)]
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        _kill_all(children)


def test_an_idle_engine_killed_takes_its_workers_with_it(checkpoint):
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(checkpoint)], stdout=subprocess.PIPE, text=True
    )
    children: list[int] = []
    try:
        assert engine.stdout.readline().strip() == "ready"
        children = _children(engine.pid)
        segments = set().union(*(_shm_mapped(pid) for pid in [engine.pid, *children]))
        engine.kill()
        engine.wait()
        _assert_all_gone(children)
        assert not [path for path in segments if os.path.exists(path)]
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        engine.stdout.close()
        _kill_all(children)


def test_a_worker_dying_while_the_engine_is_idle_makes_it_dead_before_any_step(checkpoint):
    engine = LLMEngine(EngineArgs(model=str(checkpoint), tensor_parallel_size=2, **KNOBS))
    told = []
    engine.on_death(told.append)
    try:
        assert engine.dead_reason is None
        (worker,) = engine.executor.procs
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        while engine.dead_reason is None:
            assert time.monotonic() - start < 1.0, "the idle engine did not see its rank die"
            time.sleep(0.01)
        assert "rank 1" in engine.dead_reason and "died" in engine.dead_reason
        assert told == [engine.dead_reason]
        # the next request's first step says so
        engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.step()
    finally:
        engine.shutdown()
