"""`serve -dp 2 --data-parallel-backend ray`: a replica whose actor process is killed outright
(SIGKILL) is started again in a new actor on its bundle, at its old address, and serves there.
Skipped only where Ray is not installed."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest
from router_util import complete, wait_for

pytest.importorskip("ray")

from test_serve_data_parallel_ray import cluster, serve_args  # noqa: E402, F401

from pagedllm.cli.app import _serve  # noqa: E402
from pagedllm.router.ray_launcher import run_data_parallel_ray  # noqa: E402


def listener_pid(port: int) -> int:
    """The process listening on TCP `port` here."""
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise LookupError(f"nothing listens on port {port}")


def instance(url: str) -> str | None:
    try:
        return httpx.get(f"{url}/load", timeout=2).json()["instance_id"]
    except httpx.TransportError:
        return None


def test_a_killed_replica_actor_is_restarted_at_its_address(cluster):  # noqa: F811
    def run_router(urls):
        url = urls[1]
        before = instance(url)
        os.kill(listener_pid(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        wait_for(lambda: instance(url) not in (None, before), 120, what="a new instance")
        assert complete(url, "Hello again", max_tokens=3).status_code == 200
        return 0

    assert run_data_parallel_ray(serve_args(), _serve, run_router) == 0
