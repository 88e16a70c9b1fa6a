"""`serve -dp N` and `LLM(data_parallel_size=N)` refuse what their launchers would refuse once
some replicas run (more replicas than a router indexes, event ports past 65535, a router
address this machine cannot listen on) before any process starts, naming the flag."""

from __future__ import annotations

import socket

import pytest

from pagedllm import LLM
from pagedllm._core import MAX_ROUTER_REPLICAS
from pagedllm.cli.app import build_parser
from pagedllm.cli.commands import serve
from pagedllm.executor.supervisor import ProcessSupervisor


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails the test if any replica process is spawned."""

    def spawn(*args, **kwargs):
        raise AssertionError("a replica process was started")

    monkeypatch.setattr(ProcessSupervisor, "spawn", spawn)


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "--device", "cpu", *flags])


def test_serve_with_more_replicas_than_a_router_indexes_starts_none(no_spawn):
    args = serve_args("-dp", str(MAX_ROUTER_REPLICAS + 1))
    with pytest.raises(ValueError, match="--data-parallel-size.* at most 64"):
        serve.run(args)


def test_serve_whose_last_replica_event_port_passes_65535_starts_none(no_spawn):
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:65534"}'
    args = serve_args("-dp", "3", "--kv-events-config", config)
    with pytest.raises(ValueError, match="tcp://\\*:65534 \\+ 2 .*--data-parallel-size"):
        serve.run(args)


def test_serve_on_a_router_port_already_taken_starts_none(no_spawn):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--host 127.0.0.1 --port {port}"):
            serve.run(serve_args("-dp", "2", "--port", str(port)))


def test_serve_on_a_port_past_65535_starts_none(no_spawn):
    with pytest.raises(ValueError, match="--port 70000"):
        serve.run(serve_args("-dp", "2", "--port", "70000"))


def test_llm_with_more_replicas_than_a_router_indexes_starts_none(no_spawn):
    with pytest.raises(ValueError, match="data_parallel_size .* at most 64"):
        LLM(device="cpu", data_parallel_size=MAX_ROUTER_REPLICAS + 1)


def test_serve_on_ray_without_ray_installed_starts_none(no_spawn, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="--data-parallel-backend.* needs Ray"):
        serve.run(serve_args("-dp", "2", "--data-parallel-backend", "ray"))
