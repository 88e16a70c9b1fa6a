"""`pagedllm serve -dp 2`: two engine processes behind the router in one command; they serve,
both are in rotation; a replica killed outright is routed around (requests still succeed) and
leaves rotation; SIGTERM stops the router and the replicas (no process left); a front end killed
outright (SIGKILL) leaves no replica and no socket or socket folder behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from router_util import MODEL, bound_sockets, complete, wait_for

from server_util import free_port, wait_healthy


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_serve_dp_2_serves_survives_a_killed_replica_and_stops_them_all():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "-dp", "2", "--port", str(port)]
    cmd += ["--model", MODEL, "--max-model-len", "128", "--num-gpu-blocks", "32"]
    cmd += ["--cpu-threads", "1", "--log-level", "warning", "--shutdown-grace", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, url)
        replicas = [
            c
            for c in children(proc.pid)
            if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()
        ]
        assert len(replicas) == 2
        for i in range(4):
            assert complete(url, f"data parallel {i}").status_code == 200

        def both_up() -> bool:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            return all(f'replica_up{{engine="{i}"}} 1.0' in text for i in (0, 1))

        wait_for(both_up, what="both replicas in rotation")
        os.kill(replicas[1], signal.SIGKILL)
        for i in range(4):
            assert complete(url, f"one replica gone {i}").status_code == 200

        def one_down() -> bool:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            return sum(f'replica_up{{engine="{i}"}} 0.0' in text for i in (0, 1)) == 1

        wait_for(one_down, what="the killed replica to leave rotation")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not [pid for pid in replicas if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_front_end_killed_outright_leaves_no_replica_and_no_sockets_behind(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "-dp", "2", "--port", str(port)]
    cmd += ["--model", MODEL, "--max-model-len", "128", "--num-gpu-blocks", "32"]
    cmd += ["--cpu-threads", "1", "--log-level", "warning", "--shutdown-grace", "1"]
    # a private TMPDIR: a socket folder made there (where the platform needs one) is ours
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        replicas = [
            c
            for c in children(proc.pid)
            if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()
        ]
        (folder,) = tmp_path.glob("pagedllm-dp-*")  # the private socket folder
        mine = f"{folder}/"
        assert len(bound_sockets(mine)) == 4  # each replica's events and replay sockets
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_for(lambda: not [p for p in replicas if alive(p)], 60, what="the replicas to exit")
    assert not bound_sockets(mine)
    assert not list(tmp_path.glob("pagedllm-dp-*"))
