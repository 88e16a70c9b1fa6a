"""A live server on 127.0.0.1 for the entrypoint tests: uvicorn in a background thread over the
built-in tiny model, on a free port, stopped when the module's tests are done."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time

import httpx
import uvicorn

from pagedllm.entrypoints.api_server import ServerConfig, build_server_app

MODEL = "pagedllm/tiny-random"
ENGINE = dict(model=MODEL, max_model_len=128, num_gpu_blocks=64, block_size=16, max_num_seqs=16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app, port: int) -> None:
        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def engine(self):
        return self.app.state.server.engine

    def metric(self, name: str) -> float:
        """One unlabelled sample of /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request is running or waiting and the KV cache is empty (per /metrics)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                self.metric("pagedllm:kv_cache_usage_perc") == 0.0
                and self.metric("pagedllm:num_requests_running") == 0.0
                and self.metric("pagedllm:num_requests_waiting") == 0.0
            ):
                return
            time.sleep(0.05)
        raise AssertionError("the server did not become idle (requests or KV blocks leaked)")


def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    """Waits until the server process `proc` answers /health with 200 (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the server exited early"
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


@contextlib.contextmanager
def live_server(engine: dict | None = None, **config):
    config.setdefault("served_model_name", MODEL)
    app = build_server_app({**ENGINE, **(engine or {})}, ServerConfig(**config))
    live = LiveServer(app, free_port())
    live.thread.start()
    deadline = time.monotonic() + 60
    while not live.server.started:
        if not live.thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield live
    finally:
        live.server.should_exit = True
        live.thread.join(timeout=30)
