"""A `max_tokens` that cannot fit the context with the prompt is a 400 naming the field and the
limit, as OpenAI and vLLM answer; left unset, generation stops at max_model_len."""

from __future__ import annotations

import httpx

from server_util import ENGINE, MODEL

LIMIT = ENGINE["max_model_len"]
PROMPT = [5, 6, 7, 8]  # four token ids: at most LIMIT - 4 can be generated


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=30)


def test_completion_max_tokens_beyond_the_context_is_400_naming_it(server):
    response = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10**9})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert f"max_tokens={10**9}" in error["message"]
    assert f"max_model_len is {LIMIT}" in error["message"]
    assert f"at most {LIMIT - len(PROMPT)}" in error["message"]


def test_completion_max_tokens_filling_the_context_exactly_is_served(server):
    body = {"prompt": PROMPT, "max_tokens": LIMIT - len(PROMPT), "ignore_eos": True}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == LIMIT - len(PROMPT)


def test_chat_max_completion_tokens_beyond_the_context_is_400_naming_it(server):
    messages = [{"role": "user", "content": "Hi"}]
    body = {"messages": messages, "max_completion_tokens": LIMIT}
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert f"max_model_len is {LIMIT}" in error["message"]


def test_chat_without_max_tokens_is_not_refused(server):
    messages = [{"role": "user", "content": "Hi"}]
    response = _post(server, "/v1/chat/completions", {"messages": messages})
    assert response.status_code == 200, response.text
