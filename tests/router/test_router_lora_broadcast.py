"""The runtime LoRA routes through the router go to every replica: all succeed -> the replica's
answer; the same client error everywhere -> that error unchanged; anything else -> a 502 naming
what happened on each replica."""

from __future__ import annotations

import httpx
import pytest
from fake_replica import FakeReplica
from router_util import start, stop

from pagedllm.router.app import build_router_app
from pagedllm.router.replicas import ReplicaSet

from server_util import free_port

LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


@pytest.fixture
def router_over(tmp_path):
    """A router over fake replicas answering the given statuses to the LoRA routes."""
    made = []

    def build(*statuses: int):
        fakes = [
            FakeReplica(tmp_path, f"r{i}", "--lora-status", str(s)) for i, s in enumerate(statuses)
        ]
        replicas = ReplicaSet([f.url for f in fakes], block_size=16, policy="round_robin")
        router = start(build_router_app(replicas), free_port())
        made.append((router, fakes))
        return router.url, fakes

    yield build
    for router, fakes in made:
        stop(router)
        for fake in fakes:
            fake.close()


def calls(fake: FakeReplica) -> list[str]:
    log = fake.load_file.parent / f"{fake.load_file.name}.lora.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_load_reaches_every_replica(router_over):
    url, fakes = router_over(200, 200)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=LOAD, timeout=10)
    assert r.status_code == 200 and r.text.startswith("Success: LoRA adapter 'sql'")
    assert r.headers["content-type"].startswith("text/plain")
    assert [calls(f) for f in fakes] == [["/v1/load_lora_adapter sql"]] * 2
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=10)
    assert r.status_code == 200
    assert [len(calls(f)) for f in fakes] == [2, 2]


def test_the_same_client_error_from_every_replica_is_passed_unchanged(router_over):
    url, fakes = router_over(400, 400)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=LOAD, timeout=10)
    direct = httpx.post(f"{fakes[0].url}/v1/load_lora_adapter", json=LOAD, timeout=10)
    assert (r.status_code, r.json()) == (400, direct.json())


def test_a_load_that_fails_on_one_replica_is_a_502_naming_it(router_over):
    url, _ = router_over(200, 400)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=LOAD, timeout=10)
    assert r.status_code == 502
    error = r.json()["error"]
    assert "loaded on [0] only" in error["message"]
    assert "replica 1: 400 no adapter there" in error["message"]
    assert [o["status"] for o in error["replicas"]] == [200, 400]
