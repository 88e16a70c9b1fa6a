"""`pagedllm router` in front of two replicas (in-process `pagedllm serve` apps over the tiny
model, KV events over ipc): outputs equal a single engine's, conversations stick to the replica
holding their prefix, the index equals the replicas' caches, beam searches (`use_beam_search`)
run whole on the replica picked for them, a stopped replica is routed around and rejoins."""

from __future__ import annotations

import json

import httpx
import pytest
from router_util import (
    MODEL,
    REPLICA_HEADER,
    cached_hashes,
    complete,
    two_routed_replicas,
    wait_for,
)

from pagedllm._core import hash_block_chain


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with two_routed_replicas(tmp_path_factory.mktemp("events")) as replicas_and_router:
        yield replicas_and_router


def served_by(response: httpx.Response) -> int:
    return int(response.headers[REPLICA_HEADER])


def chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def index_matches_caches(replicas, state) -> bool:
    for i, live in enumerate(replicas):
        engine = live.engine.engine
        with state.lock:
            ours = sorted(state.router.replica_hashes(i).tolist())
        if ours != cached_hashes(engine):
            return False
    return True


def test_greedy_outputs_through_the_router_equal_a_single_engines(cluster):
    replicas, router, _ = cluster
    for prompt in ("Hello, my name is", [256, 72, 105, 33, 10]):
        direct = complete(replicas[0].url, prompt, max_tokens=8).json()
        proxied = complete(router.url, prompt, max_tokens=8).json()
        assert proxied["choices"][0]["text"] == direct["choices"][0]["text"]
    messages = [{"role": "user", "content": "Tell me a story."}]
    direct = chat(replicas[1].url, messages, max_tokens=8).json()
    assert chat(router.url, messages, max_tokens=8).json()["choices"] == direct["choices"]


def test_beam_searches_run_on_the_replica_holding_their_prefix_as_on_one_engine(cluster):
    replicas, router, state = cluster
    prefixes = ["Beam prefix held by replica zero, long enough. " * 2, "Replica one's beams. " * 4]
    for live, prefix in zip(replicas, prefixes):  # each replica caches one prefix
        assert complete(live.url, prefix, max_tokens=1).status_code == 200
    firsts = [
        hash_block_chain(live.engine.engine.tokenizer.encode(prefix), 16)[0]
        for live, prefix in zip(replicas, prefixes)
    ]

    def indexed() -> bool:
        with state.lock:
            return all(
                h in set(state.router.replica_hashes(i).tolist()) for i, h in enumerate(firsts)
            )

    wait_for(indexed, what="the replicas' KV events")
    beam = {"use_beam_search": True, "n": 2, "best_of": 3, "ignore_eos": True}
    for index, prefix in enumerate(prefixes):
        prompt = prefix + "and then"
        proxied = complete(router.url, prompt, max_tokens=6, **beam)
        assert proxied.status_code == 200 and served_by(proxied) == index
        direct = complete(replicas[1 - index].url, prompt, max_tokens=6, **beam).json()
        assert proxied.json()["choices"] == direct["choices"]
        assert len(direct["choices"]) == 2


def test_a_stream_through_the_router_equals_the_single_engines_text(cluster):
    replicas, router, _ = cluster
    body = {"model": MODEL, "prompt": "Streaming, please", "max_tokens": 6, "temperature": 0}
    direct = httpx.post(f"{replicas[0].url}/v1/completions", json=body, timeout=60).json()
    text = ""
    with httpx.stream(
        "POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == direct["choices"][0]["text"]


def test_a_conversations_later_turns_go_to_the_replica_holding_its_prefix(cluster):
    _, router, _ = cluster
    for topic in ("sailing boats and the open sea", "mountains, snow and skiing in winter"):
        messages = [
            {"role": "system", "content": f"You are an expert on {topic}. " * 2},
            {"role": "user", "content": "Where should I start?"},
        ]
        first = chat(router.url, messages)
        home = served_by(first)
        for turn in range(3):
            reply = first.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"And then, step {turn}?"},
            ]
            first = chat(router.url, messages)
            assert first.status_code == 200, first.text
            assert served_by(first) == home, f"turn {turn + 2} of {topic!r}"
            assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_index_equals_every_replicas_prefix_cache(cluster):
    replicas, router, state = cluster
    for i in range(6):
        complete(router.url, f"Distinct prompt number {i} " * 4)
    for live in replicas:
        live.wait_idle()
    wait_for(lambda: index_matches_caches(replicas, state), what="the index to match")


def test_metrics_count_routed_requests_and_hit_rate_per_replica(cluster):
    _, router, _ = cluster
    complete(router.url, "count me")
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert 'pagedllm_router:routed_requests_total{engine="0"}' in text
    assert 'pagedllm_router:prefix_hit_rate{engine="1"}' in text
    assert 'pagedllm_router:replica_up{engine="0"} 1.0' in text


def test_a_body_that_is_not_json_is_a_400(cluster):
    _, router, _ = cluster
    response = httpx.post(f"{router.url}/v1/completions", content=b"{nope", timeout=10)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_a_client_error_is_relayed_as_the_replica_answered_it(cluster):
    _, router, _ = cluster
    response = complete(router.url, "x", max_tokens=-1)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_finished_requests_give_back_their_uncached_tokens(cluster):
    _, router, state = cluster
    complete(router.url, "A prompt no replica has seen yet, long enough for blocks " * 3)
    body = {"model": MODEL, "prompt": "Another unseen prompt " * 5, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        r.read()
    wait_for(lambda: all(s["in_flight"] == 0 for s in state.stats()), what="the requests to finish")
    assert [s["uncached_tokens"] for s in state.stats()] == [0, 0]
