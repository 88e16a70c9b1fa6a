"""`prompt_token_ids` (what a router forwards) run in place of rendering or tokenizing, checked
as token-id prompts are; `/tokenize` renders tools; `/load` describes
the renderer a router loads to get the server's own ids."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.protocol import ChatCompletionRequest
from pagedllm.entrypoints.rendering import Renderer

from server_util import MODEL, live_server

IDS = [256, 72, 105, 33, 10]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Add two and two."}]


@pytest.fixture(scope="module")
def server():
    with live_server({"max_model_len": 512, "num_gpu_blocks": 96}) as live:  # room for tools
        yield live


def post(server, path: str, body: dict) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_a_chats_prompt_token_ids_run_in_place_of_its_messages(server):
    chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "prompt_token_ids": IDS})
    completion = post(server, "/v1/completions", {"prompt": IDS})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(IDS)
    text = completion.json()["choices"][0]["text"]
    assert chat.json()["choices"][0]["message"]["content"] == text


def test_prompt_token_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(server):
    body = {"messages": MESSAGES, "prompt_token_ids": [1, 10**6]}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "outside the vocabulary" in response.json()["error"]["message"]


def test_a_completions_prompt_token_ids_must_pair_with_its_prompts(server):
    response = post(server, "/v1/completions", {"prompt": ["a", "b"], "prompt_token_ids": [IDS]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_token_ids"


def test_a_text_prompts_given_ids_are_run_and_its_text_is_echoed(server):
    body = {"prompt": "Hi!", "prompt_token_ids": [IDS], "echo": True, "max_tokens": 1}
    response = post(server, "/v1/completions", body).json()
    assert response["usage"]["prompt_tokens"] == len(IDS)
    assert response["choices"][0]["text"].startswith("Hi!")


def tokenize(server, body: dict) -> dict:
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()


def test_tokenize_renders_the_tools_as_chat_does(server):
    plain = tokenize(server, {"messages": MESSAGES})["tokens"]
    with_tools = tokenize(server, {"messages": MESSAGES, "tools": TOOLS})
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    chat = post(server, "/v1/chat/completions", body)
    assert with_tools["count"] > len(plain)
    assert chat.json()["usage"]["prompt_tokens"] == with_tools["count"]


def test_the_renderer_on_load_gives_the_servers_own_ids(server):
    description = httpx.get(f"{server.url}/load", timeout=10).json()["renderer"]
    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
    ids = Renderer.load(description).chat_ids(ChatCompletionRequest.model_validate(request))
    tokenized = tokenize(server, {"messages": MESSAGES, "tools": TOOLS})
    assert ids == tokenized["tokens"]
