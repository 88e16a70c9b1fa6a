"""The routes beyond completions and chat through `pagedllm router` in front of two replicas:
`/v1/responses` (streamed too) as a replica answers it and routed by its rendered prompt (a
repeated instruction goes to the replica holding it), a replica's 4xx relayed unchanged, and
`/v1/embeddings`, `/v1/score`, `/v1/rerank` on pooling replicas equal to a replica's answer."""

from __future__ import annotations

import json

import httpx
import pytest
from pooling.checkpoints import save_embedding_checkpoint
from router_util import MODEL, REPLICA_HEADER, two_routed_replicas

from pagedllm.router.routes import routing_ids

INSTRUCTIONS = "You are a careful assistant. " * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with two_routed_replicas(tmp_path_factory.mktemp("events")) as replicas_and_router:
        yield replicas_and_router


def respond(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "input": "Where do I start?", "max_output_tokens": 6, **extra}
    return httpx.post(f"{url}/v1/responses", json={"temperature": 0, **body}, timeout=60)


def output_text(answer: dict) -> str:
    return "".join(
        part["text"]
        for item in answer["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def test_a_response_through_the_router_equals_a_replicas(cluster):
    replicas, router, _ = cluster
    direct = respond(replicas[0].url, instructions="Be brief.")
    proxied = respond(router.url, instructions="Be brief.")
    assert proxied.status_code == 200, proxied.text
    assert output_text(proxied.json()) == output_text(direct.json())


def test_a_streamed_response_through_the_router_keeps_its_events(cluster):
    replicas, router, _ = cluster
    answer = respond(replicas[1].url).json()
    direct = output_text(answer)
    body = {"model": MODEL, "input": "Where do I start?", "max_output_tokens": 6}
    events, text = [], ""
    with httpx.stream(
        "POST", f"{router.url}/v1/responses", json={**body, "temperature": 0, "stream": True}
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                events.append(event["type"])
                if event["type"] == "response.output_text.delta":
                    text += event["delta"]
    # completed, or incomplete where max_output_tokens cut it (as the replica's answer says)
    assert events[0] == "response.created" and events[-1] == f"response.{answer['status']}"
    assert text == direct


def test_a_response_is_routed_by_the_prompt_its_replica_renders(cluster):
    _, router, state = cluster
    renderer, _ = state.renderer()
    body = {"model": MODEL, "input": "Hi", "instructions": INSTRUCTIONS, "max_output_tokens": 1}
    ids = routing_ids(renderer, "/v1/responses", body)
    before = prompt_tokens_counted(router.url)
    answer = httpx.post(f"{router.url}/v1/responses", json=body, timeout=60).json()
    assert len(ids) == answer["usage"]["input_tokens"]
    # the router counts a Responses answer's usage (input_tokens) like a completion's
    assert prompt_tokens_counted(router.url) == before + len(ids)


def prompt_tokens_counted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("pagedllm_router:prompt_tokens")]
    return sum(float(line.split()[-1]) for line in lines if "_created" not in line)


@pytest.mark.parametrize("topic", ["sailing boats", "mountain huts"])
def test_a_repeated_instruction_goes_to_the_replica_holding_it(cluster, topic):
    _, router, _ = cluster
    instructions = f"You are a careful assistant who answers about {topic}. " * 3
    first = respond(router.url, instructions=instructions)
    again = respond(router.url, instructions=instructions, input="And then?")
    assert again.headers[REPLICA_HEADER] == first.headers[REPLICA_HEADER]
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_a_replicas_client_error_is_relayed_unchanged(cluster):
    replicas, router, _ = cluster
    body = {"model": MODEL, "input": "x"}  # embeddings from a generating server
    direct = httpx.post(f"{replicas[0].url}/v1/embeddings", json=body, timeout=30)
    proxied = httpx.post(f"{router.url}/v1/embeddings", json=body, timeout=30)
    assert direct.status_code == 400
    assert (proxied.status_code, proxied.json()) == (direct.status_code, direct.json())


@pytest.fixture(scope="module")
def pooling_cluster(tmp_path_factory):
    model = save_embedding_checkpoint(tmp_path_factory.mktemp("embed"))
    folder = tmp_path_factory.mktemp("pooling-events")
    engine = {"model": str(model), "runner": "pooling", "max_model_len": 256}
    with two_routed_replicas(folder, ("pa", "pb"), **engine) as (replicas, router, _):
        yield replicas, router


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": ["hello world", "paged attention"]}),
        ("/v1/score", {"text_1": "hello", "text_2": ["hello world", "the fox"]}),
        ("/v1/rerank", {"query": "hello", "documents": ["the fox", "hello world"]}),
    ],
)
def test_pooling_routes_through_the_router_equal_a_replicas(pooling_cluster, path, body):
    replicas, router = pooling_cluster
    direct = httpx.post(f"{replicas[0].url}{path}", json=body, timeout=30)
    proxied = httpx.post(f"{router.url}{path}", json=body, timeout=30)
    assert direct.status_code == proxied.status_code == 200, proxied.text
    strip = {"id", "created"}
    assert {k: v for k, v in proxied.json().items() if k not in strip} == {
        k: v for k, v in direct.json().items() if k not in strip
    }
