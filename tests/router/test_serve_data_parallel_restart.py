"""`pagedllm serve -dp 2`: a replica killed outright (SIGKILL) is started again on its address;
the router counts the restart on /metrics, takes it back into rotation, rebuilds its part of
the index from the new instance's KV events, and requests are served there again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from router_util import MODEL, complete, wait_for
from test_serve_data_parallel import alive, children

from server_util import free_port, wait_healthy

# 40 tokens: two full 16-token blocks the index can find again
PROMPT = list(range(100, 140))


def metric(url: str, name: str, engine: int) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{engine="{engine}"}} '):
            return float(line.split()[1])
    raise KeyError(name)


def replica_pids(pid: int) -> list[int]:
    return [
        c for c in children(pid) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()
    ]


def test_a_killed_replica_is_restarted_and_serves_again():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "-dp", "2", "--port", str(port)]
    cmd += ["--model", MODEL, "--max-model-len", "128", "--num-gpu-blocks", "32"]
    cmd += ["--cpu-threads", "1", "--log-level", "warning", "--shutdown-grace", "1"]
    cmd += ["--routing-policy", "round_robin"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    replicas: list[int] = []
    try:
        wait_healthy(proc, url)
        replicas = replica_pids(proc.pid)
        assert len(replicas) == 2
        killed = replicas[1]
        os.kill(killed, signal.SIGKILL)
        started = time.monotonic()

        def restarted() -> bool:
            restarts = sum(metric(url, "pagedllm_router:replica_restarts_total", i) for i in (0, 1))
            up = all(metric(url, "pagedllm_router:replica_up", i) == 1.0 for i in (0, 1))
            return restarts == 1 and up

        wait_for(restarted, 90, what="the killed replica to be restarted and back in rotation")
        restart_s = time.monotonic() - started
        replicas = replica_pids(proc.pid)
        assert len(replicas) == 2 and killed not in replicas
        engine = next(i for i in (0, 1) if metric(url, "pagedllm_router:replica_restarts_total", i))
        hits = metric(url, "pagedllm_router:prefix_hit_blocks_total", engine)

        def served_from_its_rebuilt_index() -> bool:
            # round robin: the prompt lands on each replica in turn; once the new instance's
            # events are in, the router finds its blocks there
            answer = complete(url, PROMPT)
            assert answer.status_code == 200
            return metric(url, "pagedllm_router:prefix_hit_blocks_total", engine) > hits

        wait_for(served_from_its_rebuilt_index, 30, what="a prefix hit on the restarted replica")
        print(f"restarted and back in rotation {restart_s:.1f} s after SIGKILL")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        wait_for(lambda: not [p for p in replicas if alive(p)], 60, what="the replicas to exit")
