"""The server over a tensor-parallel engine whose rank died: the first failed step ends the engine
(no retries: a rank does not come back), live and new requests get 503, /health fails, and
`pagedllm serve` exits with status 1 leaving no worker process or shared-memory segment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pagedllm.entrypoints.async_engine import MAX_FAILED_STEPS
from pagedllm.executor.multiproc import EngineDeadError

from model_factory import save_tiny_checkpoint
from server_util import MODEL, free_port, live_server, wait_healthy

BODY = {"model": MODEL, "prompt": "go", "max_tokens": 4, "ignore_eos": True, "temperature": 0}


def test_a_dead_rank_ends_the_engine_at_the_first_failed_step():
    with live_server() as live:
        steps = []

        def dead_rank_step():
            steps.append(1)
            raise EngineDeadError("tensor-parallel rank 1 (pid 1) died (exit code -9)")

        live.engine.engine.step = dead_rank_step
        response = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
        assert response.status_code == 503
        assert "rank 1" in response.json()["error"]["message"]
        # one step, not the MAX_FAILED_STEPS a transient fault gets
        assert len(steps) == 1 < MAX_FAILED_STEPS
        assert live.engine.dead
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503
        assert "rank 1" in health.json()["error"]["message"]
        refused = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
        assert refused.status_code == 503


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


def _tp_worker(server_pid: int) -> int:
    """The spawned rank-1 process (not multiprocessing's resource tracker)."""
    for child in _children(server_pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return child
    raise AssertionError(f"no tensor-parallel worker among {_children(server_pid)}")


def _shm_segments(pid: int) -> set[str]:
    """The /dev/shm files process `pid` has mapped or open."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    found = {line.split()[-1] for line in maps if "/dev/shm/" in line}
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            found.add(target.removesuffix(" (deleted)"))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of a dead parent is reaped by init: count it as gone
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _serve_tp(tmp_path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`pagedllm serve -tp 2` over a tiny checkpoint: the process and its URL."""
    folder = save_tiny_checkpoint(tmp_path / "llama", "llama", seed=3)
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--model", str(folder)]
    cmd += ["--port", str(port), "-tp", "2", "--device", "cpu", "--cpu-threads", "1"]
    cmd += ["--max-model-len", "256", "--num-gpu-blocks", "32", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "PAGEDLLM_API_KEY": ""})
    return proc, f"http://127.0.0.1:{port}"


def _health_fails_within(url: str, seconds: float) -> float:
    """Seconds until /health stops answering 200 (a 503, or the server gone); fails past
    `seconds`."""
    start = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=seconds).status_code != 200:
                break
        except httpx.TransportError:
            break
        assert time.monotonic() - start < seconds, f"/health still 200 after {seconds}s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_serve_with_a_killed_worker_answers_503_and_exits_1_leaving_nothing(tmp_path):
    proc, url = _serve_tp(tmp_path)
    worker = None
    try:
        wait_healthy(proc, url)
        worker = _tp_worker(proc.pid)
        segments = _shm_segments(proc.pid) | _shm_segments(worker)
        body = {"prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            os.kill(worker, signal.SIGKILL)  # mid-generation
            chunks = [line for line in lines if line.startswith("data:")]
        # the stream had begun (status 200): the failure is its last event
        assert chunks[-1] == "data: [DONE]"
        error = json.loads(chunks[-2][len("data: ") :])["error"]
        assert error["code"] == 503
        assert "rank 1" in error["message"]
        # the server does not live on refusing everything: it exits for its supervisor
        with contextlib.suppress(httpx.TransportError):  # or already gone
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert proc.wait(timeout=30) == 1
        deadline = time.monotonic() + 10
        while not _gone(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived the server"
            time.sleep(0.05)
        assert not [path for path in segments if os.path.exists(path)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_serve_with_a_worker_killed_while_idle_fails_health_at_once_and_exits_1(tmp_path):
    proc, url = _serve_tp(tmp_path)
    worker = None
    try:
        wait_healthy(proc, url)
        worker = _tp_worker(proc.pid)
        segments = _shm_segments(proc.pid) | _shm_segments(worker)
        os.kill(worker, signal.SIGKILL)  # no request in flight: nothing steps
        _health_fails_within(url, 2.0)
        assert proc.wait(timeout=30) == 1
        assert not [path for path in segments if os.path.exists(path)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_declares_a_frozen_worker_dead_within_its_tp_step_timeout(tmp_path):
    proc, url = _serve_tp(tmp_path, "--tp-step-timeout", "2")
    worker = None
    try:
        wait_healthy(proc, url)
        worker = _tp_worker(proc.pid)
        os.kill(worker, signal.SIGSTOP)  # alive, never answers
        start = time.monotonic()
        body = {"prompt": "go", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 503
        assert "rank 1" in response.json()["error"]["message"]
        assert time.monotonic() - start < 2.0 + 1.5
        assert proc.wait(timeout=30) == 1
        deadline = time.monotonic() + 10
        while not _gone(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived the server"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)
