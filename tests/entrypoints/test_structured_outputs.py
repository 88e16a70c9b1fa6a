"""Structured output over HTTP: `response_format` on chat and vLLM's `structured_outputs` extra
body on completions and chat constrain the output; bad ones are a 400 naming the problem, and
the server keeps serving."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server_util import MODEL

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["x", "y"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def _chat(server, **fields) -> httpx.Response:
    messages = [{"role": "user", "content": "answer"}]
    return _post(server, "/v1/chat/completions", {"messages": messages, **fields})


def test_chat_response_format_json_schema(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    response = _chat(server, response_format=response_format, max_tokens=60, seed=1)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert set(json.loads(choice["message"]["content"])) == {"ok", "pick"}


def test_chat_response_format_json_object(server):
    response = _chat(server, response_format={"type": "json_object"}, max_tokens=8, seed=2)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith("{")


def test_completions_structured_outputs_extra_body(server):
    body = {"prompt": "x", "max_tokens": 20, "structured_outputs": {"regex": "[0-9]{3}-ok"}}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch("[0-9]{3}-ok", choice["text"])


def test_chat_structured_outputs_choice_through_the_openai_client(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "pick"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert reply.choices[0].message.content in ("left", "right")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"structured_outputs": {"json": {"type": "strin"}}}, "invalid JSON schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "invalid regex"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one constraint"),
        ({"structured_outputs": {"pattern": "a"}}, "takes the keys"),
        ({"structured_outputs": {"choice": []}}, "StructuredOutputsParams.choice"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "not both",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(server, fields, message):
    response = _chat(server, max_tokens=4, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = _chat(server, max_tokens=2)
    assert ok.status_code == 200
    server.wait_idle()


def test_bad_response_format_type_is_400(server):
    response = _chat(server, max_tokens=4, response_format={"type": "yaml"})
    assert response.status_code == 400
