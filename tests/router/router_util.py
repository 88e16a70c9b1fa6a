"""Replicas and a router for the router tests: `pagedllm serve` apps on uvicorn threads (the
built-in tiny model, KV events over ipc sockets in a temporary folder) and the router app."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from pagedllm.entrypoints.api_server import ServerConfig, build_server_app  # noqa: E402
from pagedllm.router.app import build_router_app  # noqa: E402
from pagedllm.router.replicas import ReplicaSet  # noqa: E402

from server_util import ENGINE, LiveServer, free_port  # noqa: E402

MODEL = "pagedllm/tiny-random"
REPLICA_HEADER = "x-pagedllm-replica"  # the index of the replica that answered
REPLICA_ENGINE = {**ENGINE, "max_model_len": 512, "num_gpu_blocks": 96}


def events(folder: Path, name: str) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{folder}/{name}-pub",
        "replay_endpoint": f"ipc://{folder}/{name}-replay",
    }


def start(app, port: int) -> LiveServer:
    live = LiveServer(app, port)
    live.thread.start()
    deadline = time.monotonic() + 60
    while not live.server.started:
        if not live.thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return live


def stop(live: LiveServer) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=30)


def replica(folder: Path, name: str, port: int | None = None, **engine) -> LiveServer:
    config = ServerConfig(served_model_name=MODEL)
    engine_args = {**REPLICA_ENGINE, "kv_events_config": events(folder, name), **engine}
    return start(build_server_app(engine_args, config), port or free_port())


@contextlib.contextmanager
def routed(urls: list[str], policy: str = "cache_aware", **knobs):
    """A router over `urls` (polling every 0.1 s); yields (its LiveServer, its ReplicaSet)."""
    replicas = ReplicaSet(urls, block_size=16, policy=policy, health_interval=0.1, **knobs)
    live = start(build_router_app(replicas), free_port())
    try:
        yield live, replicas
    finally:
        stop(live)


@contextlib.contextmanager
def two_routed_replicas(folder: Path, names: tuple[str, str] = ("a", "b"), **engine):
    """Two replicas named `names` (their KV events over ipc sockets in `folder`, `engine` over
    the tiny model's engine arguments) behind a cache-aware router; yields (the replicas, the
    router's LiveServer, its ReplicaSet), all stopped after."""
    replicas = [replica(folder, name, **engine) for name in names]
    try:
        with routed([r.url for r in replicas]) as (router, state):
            yield replicas, router, state
    finally:
        for r in replicas:
            stop(r)


def cached_hashes(engine) -> list[int]:
    """The blocks an engine's prefix cache holds, as its KV-event publisher reports them to a
    subscriber that asks for everything (the snapshot a router resynchronises from), sorted."""
    ((_, payload),) = engine.kv_events.replay_from(-1)
    _cleared, stored = msgpack.unpackb(payload)[1]
    return sorted(stored["block_hashes"])


def wait_for(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def complete(url: str, prompt, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def bound_sockets(prefix: str) -> list[str]:
    """Unix sockets listening now whose path starts with `prefix` (abstract ones as `@name`,
    as /proc/net/unix lists them; their accepted connections, which carry the same path, are
    left out)."""
    listening = 0x10000  # __SO_ACCEPTCON in the Flags column
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return [
        row[7]
        for row in rows
        if len(row) > 7 and int(row[3], 16) & listening and row[7].startswith(prefix)
    ]


def leftover_sockets(folder: str) -> list[str]:
    """What is left of `launcher.socket_folder`'s `folder`: its bound sockets, and the folder
    itself where it is one on disk."""
    if folder.startswith("@"):
        return bound_sockets(folder + "/")
    return [folder] if Path(folder).exists() else []
