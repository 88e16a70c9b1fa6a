"""Hostile or unusual request bodies: a lone surrogate, a schema nested too deeply, explicit
nulls, `max_completion_tokens: 0`. Each is a 400 naming the field (or accepted, for null as
OpenAI's API accepts it), never a 500."""

from __future__ import annotations

import json

import httpx
import pytest

from server_util import MODEL

CHAT = [{"role": "user", "content": "hi"}]


def _post_raw(server, path: str, text: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=text, headers=headers, timeout=60)


def _post(server, path: str, body: dict) -> httpx.Response:
    # json.dumps writes a lone surrogate as the escape "\ud800": valid JSON, not valid Unicode
    return _post_raw(server, path, json.dumps({"model": MODEL, **body}))


def _assert_400(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt", "prompt"),
        ("/v1/completions", {"prompt": ["ok", "a\udc00"]}, "prompt", "prompt[1]"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800b"}]},
            "messages",
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages",
            "messages[0].content[0].text",
        ),
        ("/v1/completions", {"prompt": "x", "stop": ["a\ud800"]}, "stop", "stop[0]"),
        ("/v1/completions", {"prompt": "x", "user": "\ud800"}, "user", "user"),
        ("/v1/completions", {"prompt": "x", "model": "\ud800"}, "model", "model"),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"regex": "a\ud800"}},
            "structured_outputs",
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"choice": ["yes", "\ud800"]}},
            "structured_outputs",
            "structured_outputs.choice[1]",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"grammar": 'start: "\ud800"'}},
            "structured_outputs",
            "structured_outputs.grammar",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"const": "\ud800"}},
                },
            },
            "response_format",
            "response_format.json_schema.schema.const",
        ),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param, where):
    error = _assert_400(_post(server, path, {"max_tokens": 2, **body}), param)
    assert "lone surrogate" in error["message"]
    assert f"of {where} " in error["message"]


def test_surrogate_pair_escapes_are_one_character_and_accepted(server):
    response = _post(server, "/v1/completions", {"prompt": "smile \U0001f600", "max_tokens": 2})
    assert response.status_code == 200, response.text


def _with_nested_schema(body: dict, levels: int) -> str:
    """`body` as JSON text, its "SCHEMA" replaced by a schema of `levels` nested objects
    (written out: json.dumps would overflow the test's own stack)."""
    schema = '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}'
    return json.dumps(body).replace('"SCHEMA"', schema + "}}" * levels)


def test_json_schema_nested_480_levels_is_400(server):
    text = _with_nested_schema({"prompt": "x", "structured_outputs": {"json": "SCHEMA"}}, 480)
    error = _assert_400(_post_raw(server, "/v1/completions", text), "structured_outputs")
    assert "127 levels" in error["message"]


def test_json_schema_string_nested_600_levels_is_400(server):
    schema = _with_nested_schema({"json": "SCHEMA"}, 600)[len('{"json": ') : -1]
    body = {"prompt": "x", "structured_outputs": {"json": schema}}
    error = _assert_400(_post(server, "/v1/completions", body), "structured_outputs")
    assert "127 levels" in error["message"]


def test_response_format_schema_nested_480_levels_is_400(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": "SCHEMA"}}
    text = _with_nested_schema({"messages": CHAT, "response_format": fmt}, 480)
    error = _assert_400(_post_raw(server, "/v1/chat/completions", text), "response_format")
    assert "127 levels" in error["message"]


def test_body_nested_too_deeply_to_parse_is_400_saying_so(server):
    text = '{"prompt": "x", "stop": ' + "[" * 5000 + "]" * 5000 + "}"
    response = _post_raw(server, "/v1/completions", text)
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]


def test_max_completion_tokens_0_is_400_naming_it(server):
    body = {"messages": CHAT, "max_completion_tokens": 0}
    _assert_400(_post(server, "/v1/chat/completions", body), "max_completion_tokens")


def test_max_completion_tokens_limits_the_completion(server):
    body = {"messages": CHAT, "max_completion_tokens": 2, "max_tokens": 10, "ignore_eos": True}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


NULLABLE = [
    "n", "seed", "stop", "presence_penalty", "frequency_penalty", "stream", "stream_options",
    "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
    "stop_token_ids", "priority", "skip_special_tokens", "include_stop_str_in_output",
    "structured_outputs", "timeout", "temperature", "top_p", "max_tokens", "model",
]  # fmt: skip


def test_null_optional_fields_take_their_defaults_on_completions(server):
    nulls = dict.fromkeys([*NULLABLE, "logprobs", "echo", "best_of"])
    response = _post(server, "/v1/completions", {"prompt": "x", **nulls})
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 1  # n: 1
    assert body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] >= 1


def test_null_optional_fields_take_their_defaults_on_chat(server):
    nulls = dict.fromkeys(
        [*NULLABLE, "logprobs", "top_logprobs", "max_completion_tokens", "response_format"]
    )
    messages = [{"role": "user", "content": None}, {"role": "user", "content": "hi"}]
    response = _post(server, "/v1/chat/completions", {"messages": messages, **nulls})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_null_required_field_is_400_naming_it(server):
    _assert_400(_post(server, "/v1/completions", {"prompt": None}), "prompt")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [CHAT[0], {"role": "wizard", "content": "hi"}]},
            "messages[1].role",
        ),
    ],
)
def test_wrong_type_names_the_field_not_a_union_branch(server, path, body, param):
    error = _assert_400(_post(server, path, body), param)
    assert error["message"].startswith(f"{param}: ")
