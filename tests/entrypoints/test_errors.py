"""A client's mistakes get a 4xx in OpenAI's error shape naming the field; the server keeps
serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.api_server import ServerConfig, build_server_app

from server_util import MODEL, live_server


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


def _completion(server, **fields) -> httpx.Response:
    return _post(server, "/v1/completions", json={"model": MODEL, "prompt": "x", **fields})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"prompt": [256, 5000]}, "prompt"),
        ({"stop_token_ids": [5000]}, "stop_token_ids"),
        ({"prompt": "y" * 200}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"logprobs": 10**6}, "logprobs"),
    ],
)
def test_invalid_field_is_400_naming_it(server, fields, param):
    response = _completion(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize(
    "fields",
    [{"max_tokens": "ten"}, {"temperature": "hot"}, {"prompt": 12}, {"stream": "yes"}],
)
def test_wrong_type_is_400(server, fields):
    response = _completion(server, **fields)
    assert response.status_code == 400
    assert "error" in response.json()


def test_malformed_json_is_400(server):
    response = _post(
        server,
        "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_missing_prompt_is_400(server):
    response = _post(server, "/v1/completions", json={"model": MODEL})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_bad_chat_message_role_is_400(server):
    response = _post(
        server,
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
    )
    assert response.status_code == 400


def test_unknown_model_is_404(server):
    response = _completion(server, model="no-such-model")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "model"


def test_server_keeps_serving_after_bad_requests(server):
    for fields in ({"temperature": -1}, {"n": 0}, {"prompt": [999999]}):
        assert _completion(server, **fields).status_code == 400
    response = _completion(server, max_tokens=3, temperature=0)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_api_key_is_required_on_v1_but_not_on_health():
    with live_server(api_key="sekret") as live:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        url = f"{live.url}/v1/completions"
        assert httpx.post(url, json=body).status_code == 401
        wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        right = httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"})
        assert right.status_code == 200
        assert httpx.get(f"{live.url}/health").status_code == 200


def test_openapi_schema_is_served(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/completions" in schema["paths"]
    assert "/v1/chat/completions" in schema["paths"]


@pytest.mark.parametrize(
    ("key", "problem"), [("", "is empty"), (" ", "is empty"), ("k ", "whitespace")]
)
def test_api_key_no_client_can_send_is_refused_before_the_model_loads(key, problem):
    config = ServerConfig(served_model_name=MODEL, api_key=key)
    with pytest.raises(ValueError, match=problem):
        build_server_app({"model": "/no/such/model"}, config)  # never loaded
