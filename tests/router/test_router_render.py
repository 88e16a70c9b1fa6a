"""The router renders and tokenizes a request once, with its replica's renderer (loaded from what
the replica's /load describes): the ids it hashes are the ones the replica runs and caches
(tools and chat_template_kwargs included), the replica does not render or tokenize again, the
outputs are a direct request's, and a template error is the router's 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import jinja2
import pytest
from router_util import MODEL, REPLICA_ENGINE, events, routed, start, stop, wait_for

from pagedllm._core import hash_block_chain
from pagedllm.chat.template import DEFAULT_CHAT_TEMPLATE
from pagedllm.entrypoints.api_server import ServerConfig, build_server_app
from pagedllm.router.app import _Prompt
from pagedllm.router.replicas import Replica, ReplicaSet
from pagedllm.tokenizer import ByteTokenizer

from server_util import free_port

# the built-in template, with a thinking switch and a rule that can fail
TEMPLATE = (
    "{% if messages[-1]['role'] == 'assistant' %}"
    "{{ raise_exception('the last message must not be the assistant\\'s') }}{% endif %}"
    + DEFAULT_CHAT_TEMPLATE
    + "{% if enable_thinking %}<think>\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Is it raining in Oslo today?"}],
    "tools": TOOLS,
    "tool_choice": "none",
    "chat_template_kwargs": {"enable_thinking": True},
    "max_tokens": 6,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("events")
    engine = {**REPLICA_ENGINE, "kv_events_config": events(folder, "a")}
    config = ServerConfig(served_model_name=MODEL, chat_template=TEMPLATE)
    replica = start(build_server_app(engine, config), free_port())
    try:
        with routed([replica.url]) as (router, state):
            wait_for(lambda: state.renderer() is not None, what="the replica's renderer")
            yield replica, router, state
    finally:
        stop(replica)


@pytest.fixture
def counted(monkeypatch):
    """Template renders and tokenizations in this process (router and replica alike)."""
    counts = {"render": 0, "encode": 0}
    render, encode = jinja2.Template.render, ByteTokenizer.encode

    def counting_render(self, *args, **kwargs):
        counts["render"] += 1
        return render(self, *args, **kwargs)

    def counting_encode(self, *args, **kwargs):
        counts["encode"] += 1
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(jinja2.Template, "render", counting_render)
    monkeypatch.setattr(ByteTokenizer, "encode", counting_encode)
    return counts


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_a_routed_chat_request_is_rendered_and_tokenized_once(cluster, counted):
    _, router, _ = cluster
    response = post(router.url, TOOL_CHAT)
    assert response.status_code == 200, response.text
    assert counted == {"render": 1, "encode": 1}


def test_a_tool_requests_blocks_hash_to_what_its_replica_caches(cluster, monkeypatch):
    replica, router, state = cluster
    hashed = []
    route = state.route
    monkeypatch.setattr(state, "route", lambda ids, *rest: hashed.append(ids) or route(ids, *rest))
    body = {**TOOL_CHAT, "messages": [{"role": "user", "content": "Any snow in Bergen?"}]}
    response = post(router.url, body)
    assert response.status_code == 200, response.text
    (tokens,) = hashed
    assert response.json()["usage"]["prompt_tokens"] == len(tokens)
    blocks = hash_block_chain(tokens, 16)
    assert len(blocks) >= 4  # the tools and the thinking switch are in them

    def cached() -> bool:  # the index holds what the replica's KV events said it stored
        with state.lock:
            return set(blocks) <= set(state.router.replica_hashes(0).tolist())

    wait_for(cached, what="the replica's events to hold the router's blocks")


@pytest.mark.parametrize("stream", [False, True])
def test_outputs_through_the_router_equal_the_replicas(cluster, stream):
    replica, router, _ = cluster

    def answer(url: str) -> list:
        if not stream:
            return post(url, TOOL_CHAT).json()["choices"]
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json={**TOOL_CHAT, "stream": True}, timeout=60
        ) as response:
            assert response.status_code == 200
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
        # a stream's chunk boundaries follow the serving replica's timing (deltas made while a
        # chunk was sent go out together), so streams are compared by what they carry
        merged: dict[int, dict] = {}
        for c in (c for line in lines for c in json.loads(line)["choices"]):
            m = merged.setdefault(c["index"], {"text": "", "calls": "", "finish_reason": None})
            m["text"] += c["delta"].get("content") or ""
            for call in c["delta"].get("tool_calls") or []:
                fn = call.get("function") or {}
                m["calls"] += (fn.get("name") or "") + (fn.get("arguments") or "")
            m["finish_reason"] = c["finish_reason"] or m["finish_reason"]
        assert merged, "the stream carried no choice"
        return sorted(merged.items())

    assert answer(router.url) == answer(replica.url)


def test_completions_text_prompts_through_the_router_equal_the_replicas(cluster, counted):
    replica, router, _ = cluster
    body = {"model": MODEL, "prompt": ["Once upon", "a time"], "max_tokens": 5, "echo": True}
    body["temperature"] = 0
    routed_choices = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60).json()
    assert counted["encode"] == 2  # once per prompt, in the router
    direct = httpx.post(f"{replica.url}/v1/completions", json=body, timeout=60).json()
    assert routed_choices["choices"] == direct["choices"]
    assert routed_choices["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


def test_a_template_error_is_the_routers_400_in_openais_shape(cluster, counted):
    _, router, _ = cluster
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    response = post(router.url, {**TOOL_CHAT, "messages": messages})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "the last message must not be the assistant's" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert error["code"] == 400
    assert counted["render"] == 1  # the router's: the replica never got it


def test_a_renderer_the_router_cannot_load_leaves_the_ids_to_a_replicas_tokenize(caplog):
    replicas = ReplicaSet(["http://127.0.0.1:1"], block_size=16, policy="cache_aware")
    replica = replicas.replicas[0]
    asyncio.run(replicas._learn_renderer(replica, {"tokenizer": "/no/such/model/folder"}))
    assert replicas.renderer() is None
    assert "cannot be loaded here" in caplog.text


def test_without_a_renderer_a_replicas_tokenize_hashes_the_tools_too(cluster, monkeypatch):
    _, router, state = cluster
    hashed = []
    route = state.route
    monkeypatch.setattr(state, "route", lambda ids, *rest: hashed.append(ids) or route(ids, *rest))
    monkeypatch.setattr(state, "renderer", lambda: None)
    response = post(router.url, TOOL_CHAT)
    assert response.status_code == 200, response.text
    assert len(hashed[0]) == response.json()["usage"]["prompt_tokens"]


def test_the_ids_go_only_to_a_replica_that_renders_alike_and_takes_a_body_that_large():
    prompt = _Prompt([1, 2], raw=b"{}", key="ours", forwarded=b'{"prompt_token_ids": [1, 2]}')
    assert prompt.body_for(Replica(0, "u", renderer_key="ours")) == prompt.forwarded
    assert prompt.body_for(Replica(0, "u", renderer_key="theirs")) == b"{}"
    assert prompt.body_for(Replica(0, "u", renderer_key="ours", max_body_bytes=10)) == b"{}"
