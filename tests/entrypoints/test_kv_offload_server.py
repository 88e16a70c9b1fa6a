"""The server with the KV offload tier (`kv_offloading_size`): its loop keeps stepping while
the tier has transfers pending (a request parked for its load, saves after the last request
finished), and `/metrics` reports the tier."""

from __future__ import annotations

import time

import httpx
import pytest

from server_util import live_server

# 12 blocks of 16 tokens (the tiny model's tokens are bytes): two ~90-token prompts fit
ENGINE = dict(num_gpu_blocks=12, max_model_len=128, kv_offloading_size=0.01)
PROMPTS = [f"Conversation {i}: " + f"topic {i}, tell me more. " * 3 for i in range(4)]


@pytest.fixture(scope="module")
def server():
    with live_server(ENGINE) as live:
        yield live


def complete(server, prompt: str) -> dict:
    body = {
        "model": "pagedllm/tiny-random",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0.0,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the engine loop stopped stepping"
        time.sleep(0.05)


def test_saves_after_the_last_request_finished_are_run_and_reported(server):
    complete(server, PROMPTS[0])
    # nothing is running now: only the loop stepping on can run and report the save
    wait_for(lambda: server.metric("pagedllm:kv_offload_bytes_saved_total") > 0)
    wait_for(lambda: server.metric("pagedllm:kv_offload_used_blocks") > 0)
    server.wait_idle()


def test_a_prefix_evicted_from_the_device_loads_from_the_tier_with_the_same_text(server):
    first = complete(server, PROMPTS[0])
    for prompt in PROMPTS[1:]:  # each evicts the one before it from the device cache
        complete(server, prompt)
    again = complete(server, PROMPTS[0])
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert server.metric("pagedllm:kv_offload_hit_tokens_total") >= 64
    assert server.metric("pagedllm:kv_offload_bytes_loaded_total") > 0
    assert server.metric("pagedllm:kv_offload_load_latency_seconds_count") >= 1
    server.wait_idle()


def test_metrics_report_the_tiers_misses_usage_and_parked_requests(server):
    complete(server, "A prompt never seen before, long enough for blocks. " * 2)
    assert server.metric("pagedllm:kv_offload_miss_tokens_total") > 0
    assert 0 < server.metric("pagedllm:kv_offload_usage_perc") <= 1
    assert server.metric("pagedllm:num_requests_waiting_for_remote_kvs") == 0
