"""Streaming with several choices: each choice's finish chunk is sent exactly once, however many
steps its siblings run after it; `stream` with `best_of > n` is refused (it would stream the
losing candidates)."""

from __future__ import annotations

import json
from collections import Counter

import httpx

from server_util import MODEL

# sampled, a quarter of the byte tokens stop: the four choices end after different steps
SAMPLED = {
    "model": MODEL,
    "n": 4,
    "max_tokens": 24,
    "temperature": 1.0,
    "seed": 7,
    "stop_token_ids": list(range(64)),
}


def _chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _finishes(chunks: list[dict]) -> Counter:
    return Counter(c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"])


def _lengths(server, path: str, body: dict) -> set[int]:
    reply = httpx.post(f"{server.url}{path}", json=body, timeout=30).json()
    return {len(c.get("text", c.get("message", {}).get("content", ""))) for c in reply["choices"]}


def test_a_streamed_completion_finishes_each_choice_exactly_once(server):
    body = {**SAMPLED, "prompt": "several"}
    assert len(_lengths(server, "/v1/completions", body)) > 1  # choices end at different steps
    finishes = _finishes(_chunks(f"{server.url}/v1/completions", body))
    assert finishes == Counter(range(4))


def test_a_streamed_chat_finishes_each_choice_exactly_once(server):
    body = {**SAMPLED, "messages": [{"role": "user", "content": "several"}]}
    assert len(_lengths(server, "/v1/chat/completions", body)) > 1
    finishes = _finishes(_chunks(f"{server.url}/v1/chat/completions", body))
    assert finishes == Counter(range(4))


def test_streamed_choices_equal_the_non_streamed_ones(server):
    body = {**SAMPLED, "prompt": "several"}
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    streamed: dict[int, str] = {}
    for chunk in _chunks(f"{server.url}/v1/completions", body):
        for choice in chunk["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert streamed == {c["index"]: c["text"] for c in full["choices"]}


def test_stream_with_best_of_over_n_is_refused_naming_the_fields(server):
    body = {"model": MODEL, "prompt": "x", "n": 1, "best_of": 3, "stream": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "best_of"
    assert "best_of=3" in error["message"] and "n=1" in error["message"]


def test_stream_with_best_of_equal_to_n_streams_those_choices(server):
    body = {**SAMPLED, "prompt": "x", "n": 2, "best_of": 2}
    finishes = _finishes(_chunks(f"{server.url}/v1/completions", body))
    assert finishes == Counter(range(2))
