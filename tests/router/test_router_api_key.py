"""A router with an API key wants it on every route but /health and /metrics (its /tokenize and
/detokenize copies included), and sends it on its /load polls (replicas behind the same key)."""

from __future__ import annotations

import httpx
import pytest
from fake_replica import FakeReplica
from router_util import start, stop, wait_for

from pagedllm.router.app import build_router_app
from pagedllm.router.replicas import ReplicaSet

from server_util import free_port

KEY = "sesame"
COMPLETION = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
# forwarded by prompt (the first four) or to every replica (the LoRA routes)
FORWARDED = [
    ("/v1/responses", {"model": "m", "input": "hi"}),
    ("/v1/embeddings", {"model": "m", "input": "hi"}),
    ("/v1/score", {"model": "m", "text_1": "a", "text_2": "b"}),
    ("/v1/rerank", {"model": "m", "query": "a", "documents": ["b"]}),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
    ("/v1/unload_lora_adapter", {"lora_name": "a"}),
]
GUARDED = [
    *(("POST", path, body) for path, body in FORWARDED),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"model": "m", "messages": []}),
    ("POST", "/tokenize", {"model": "m", "prompt": "hi"}),
    ("POST", "/detokenize", {"model": "m", "tokens": [1]}),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
]


@pytest.fixture(scope="module")
def keyed_router(tmp_path_factory):
    fake = FakeReplica(tmp_path_factory.mktemp("keyed"), "a", "--api-key", KEY)
    replicas = ReplicaSet([fake.url], block_size=16, policy="round_robin", api_key=KEY)
    router = start(build_router_app(replicas, api_key=KEY), free_port())
    yield router.url, replicas
    stop(router)
    fake.close()


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[g[1] for g in GUARDED])
def test_every_route_but_health_and_metrics_wants_the_key(keyed_router, method, path, body):
    url, _ = keyed_router
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_health_and_metrics_are_open(keyed_router):
    url, _ = keyed_router
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200


def test_with_the_key_tokenize_and_detokenize_are_a_replicas(keyed_router):
    url, _ = keyed_router
    auth = {"authorization": f"Bearer {KEY}"}
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, headers=auth, timeout=10)
    assert tokens.status_code == 200 and tokens.json()["tokens"] == [1, 2, 3]
    text = httpx.post(f"{url}/detokenize", json={"tokens": [1]}, headers=auth, timeout=10)
    assert text.status_code == 200 and text.json()["prompt"] == "fake text"
    done = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=auth, timeout=10)
    assert done.status_code == 200


@pytest.mark.parametrize(("path", "body"), FORWARDED, ids=[f[0] for f in FORWARDED])
def test_with_the_key_the_new_routes_reach_the_replica(keyed_router, path, body):
    url, _ = keyed_router  # the replica wants the key: the router sends the client's
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}{path}", json=body, headers=auth, timeout=10).status_code == 200


def test_the_polls_carry_the_key(keyed_router):
    _, replicas = keyed_router  # the replica wants the key on /load too
    wait_for(lambda: replicas.replicas[0].instance_id == "fake", what="an answered poll")
    assert replicas.replicas[0].alive


def test_an_empty_key_is_refused():
    replicas = ReplicaSet(["http://127.0.0.1:9"], block_size=16, policy="round_robin")
    with pytest.raises(ValueError, match="API key is empty"):
        build_router_app(replicas, api_key=" ")
