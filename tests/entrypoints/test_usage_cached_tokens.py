"""`usage.prompt_tokens_details.cached_tokens` (OpenAI's field): the prompt tokens the prefix
cache served; and `GET /load`, what a data-parallel router polls."""

from __future__ import annotations

import json

import httpx

PROMPT = "The same long prompt, twice over: " * 3  # 100+ bytes: several 16-token blocks


def complete(server, **extra) -> dict:
    body = {"model": "pagedllm/tiny-random", "prompt": PROMPT, "max_tokens": 2, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()


def test_a_repeated_prompt_reports_its_cached_tokens(server):
    first = complete(server)["usage"]
    second = complete(server)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["prompt_tokens"]


def test_a_streamed_chat_reports_cached_tokens_in_its_usage_chunk(server):
    body = {
        "model": "pagedllm/tiny-random",
        "messages": [{"role": "user", "content": PROMPT[:60]}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{server.url}/v1/chat/completions"
    httpx.post(url, json={**body, "stream": False}, timeout=30)
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_load_reports_queues_block_size_and_no_events_when_off(server):
    load = httpx.get(f"{server.url}/load", timeout=10).json()
    assert load["block_size"] == 16
    assert load["kv_events"] is None
    assert load["num_gpu_blocks"] > 0  # the router bounds its index of this replica by it
    assert {"num_waiting", "num_running", "kv_usage", "instance_id", "lora_ids"} <= set(load)
