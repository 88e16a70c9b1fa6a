"""Request size: a body over `--max-request-body-bytes` is a 413 in OpenAI's error shape before
it is parsed, and a prompt that cannot fit is refused by its size before any per-token work."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.serving import DEFAULT_MAX_REQUEST_BODY_BYTES

from server_util import MODEL, live_server

BODY = {"model": MODEL, "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def small_limit():
    with live_server(max_request_body_bytes=1000) as live:
        yield live


def _assert_413(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == 413
    assert f"at most {limit} bytes" in error["message"]
    assert "--max-request-body-bytes" in error["message"]


def test_a_body_over_the_default_limit_is_413(server):
    prompt = "x" * (DEFAULT_MAX_REQUEST_BODY_BYTES + 1)
    response = httpx.post(f"{server.url}/v1/completions", json={**BODY, "prompt": prompt})
    _assert_413(response, DEFAULT_MAX_REQUEST_BODY_BYTES)


def test_a_body_over_the_configured_limit_is_413(small_limit):
    body = {**BODY, "prompt": "x" * 2000}
    _assert_413(httpx.post(f"{small_limit.url}/v1/completions", json=body), 1000)


def test_a_chunked_body_over_the_limit_is_413(small_limit):
    def chunks():  # no Content-Length: the size is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"x" * 100
        yield b'"}'

    response = httpx.post(
        f"{small_limit.url}/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    _assert_413(response, 1000)


def test_a_body_within_the_limit_is_served(small_limit):
    response = httpx.post(f"{small_limit.url}/v1/completions", json={**BODY, "prompt": "hi"})
    assert response.status_code == 200


def test_a_chunked_body_within_the_limit_is_served(small_limit):
    def chunks():
        yield b'{"prompt": "hi", '
        yield b'"max_tokens": 1}'

    response = httpx.post(
        f"{small_limit.url}/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 200


def test_a_text_prompt_too_long_by_its_size_is_refused_without_tokenizing(server):
    tokenizer = server.engine.tokenizer
    calls = []
    real_encode = tokenizer.encode
    tokenizer.encode = lambda text: calls.append(len(text)) or real_encode(text)
    try:
        body = {**BODY, "prompt": "x" * 100_000}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    finally:
        del tokenizer.encode
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert "100000 characters" in error["message"] and "max_model_len" in error["message"]
    assert calls == []


def test_an_over_long_token_id_prompt_is_refused_by_its_length_first(server):
    # over max_model_len (128) and outside the vocabulary: the length alone decides
    body = {**BODY, "prompt": [10**9] * 200}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "200 tokens" in message and "max_model_len is 128" in message
