"""Cancellation, load, admission control, timeouts, /health and /metrics."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx

from pagedllm.entrypoints.api_server import ServerConfig, build_server_app, freeze_heap

from server_util import ENGINE, MODEL, LiveServer, free_port, live_server

LONG = {"model": MODEL, "prompt": "go", "max_tokens": 100, "ignore_eos": True, "temperature": 0}


def test_health_is_200_while_the_engine_loop_runs(server):
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_expose_the_pagedllm_names(server):
    httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 3}, timeout=30)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pagedllm:num_requests_running",
        "pagedllm:num_requests_waiting",
        "pagedllm:num_requests_swapped",
        "pagedllm:kv_cache_usage_perc",
        "pagedllm:prefix_cache_queries_total",
        "pagedllm:prefix_cache_hits_total",
        "pagedllm:num_preemptions_total",
        "pagedllm:prompt_tokens_total",
        "pagedllm:generation_tokens_total",
        'pagedllm:request_success_total{finished_reason="length"}',
        "pagedllm:time_to_first_token_seconds_count",
        "pagedllm:time_per_output_token_seconds_count",
        "pagedllm:e2e_request_latency_seconds_count",
    ):
        assert name in text, name


def test_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(server):
    aborted_before = server.engine.engine.get_stats()["num_aborted"]
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=30
    ) as response:
        lines = response.iter_lines()  # held: dropping the iterator would close the response
        for line in lines:
            if line.startswith("data:"):
                break
        # the request is generating and holds KV blocks
        assert server.metric("pagedllm:kv_cache_usage_perc") > 0
    # closing the response disconnects
    server.wait_idle()
    assert server.engine.engine.get_stats()["num_aborted"] == aborted_before + 1


def test_disconnect_while_waiting_for_a_non_streamed_response_aborts_it(server):
    aborted_before = server.engine.engine.get_stats()["num_aborted"]
    # a raw connection, closed once the request is generating (a client timeout would race
    # a fast machine that finishes the request first)
    body = json.dumps(LONG).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        deadline = time.monotonic() + 10
        while server.metric("pagedllm:kv_cache_usage_perc") == 0:
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.005)
    server.wait_idle()
    assert server.engine.engine.get_stats()["num_aborted"] == aborted_before + 1


def test_timeout_field_ends_the_request_with_abort(server):
    # 120 tokens take the tiny model ~50 ms on a fast core: the deadline has to be far shorter
    body = {**LONG, "max_tokens": 120, "timeout": 0.002}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert "timeout" in choice["stop_reason"]
    server.wait_idle()


async def _stream_one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    body = {**LONG, "prompt": f"client {i} " * 3, "max_tokens": 24, "stream": True}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, ""
        last = ""
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                last = line
        return 200, last


def _run_clients(url: str, count: int) -> list[tuple[int, str]]:
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_stream_one(client, url, i) for i in range(count)))

    return asyncio.run(main())


def test_many_concurrent_streams_on_a_small_kv_cache_all_complete():
    # 12 blocks of 16 tokens: far fewer than 24 clients need at once, so requests wait and
    # are preempted, yet every one finishes and no block leaks
    with live_server(engine=dict(num_gpu_blocks=12, max_num_seqs=8)) as live:
        results = _run_clients(f"{live.url}/v1/completions", 24)
        assert [status for status, _ in results] == [200] * 24
        assert all(last == "data: [DONE]" for _, last in results)
        live.wait_idle()
        stats = live.engine.engine.get_stats()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def test_admission_limit_answers_429_with_retry_after():
    with live_server(engine=dict(num_gpu_blocks=12, max_num_seqs=2), max_queued_requests=2) as live:
        started = time.monotonic()
        results = _run_clients(f"{live.url}/v1/completions", 16)
        statuses = [status for status, _ in results]
        assert set(statuses) <= {200, 429}
        assert 429 in statuses and 200 in statuses
        assert all(last == "data: [DONE]" for status, last in results if status == 200)
        # a fresh request while the server is idle is admitted again
        response = httpx.post(f"{live.url}/v1/completions", json={**LONG, "max_tokens": 2})
        assert response.status_code == 200
        live.wait_idle()
        assert time.monotonic() - started < 60


def test_429_carries_retry_after_and_the_openai_error_shape():
    with live_server(engine=dict(max_num_seqs=1), max_queued_tokens=4) as live:
        response = httpx.post(f"{live.url}/v1/completions", json={**LONG, "prompt": "x" * 20})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "rate_limit_error"


def test_a_stuck_engine_step_fails_health_until_it_returns():
    with live_server() as live:
        live.engine.stall_timeout_s = 0.3
        engine = live.engine.engine
        real_step = engine.step
        release = threading.Event()

        def stuck_step():
            release.wait(timeout=20)
            engine.step = real_step
            return real_step()

        engine.step = stuck_step
        body = {**LONG, "max_tokens": 2}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{live.url}/v1/completions", json=body, timeout=30)
            deadline = time.monotonic() + 10
            while httpx.get(f"{live.url}/health").status_code == 200:
                assert time.monotonic() < deadline, "/health never noticed the stuck step"
                time.sleep(0.05)
            release.set()
            assert pending.result().status_code == 200
        assert httpx.get(f"{live.url}/health").status_code == 200


def _slow_steps(live, seconds: float) -> None:
    engine = live.engine.engine
    real_step = engine.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    engine.step = slow_step


def test_a_request_in_chunked_prefill_counts_as_running_not_queued():
    # one sequence at a time, 16 prompt tokens per step: a 100-token prompt prefills over 7
    # slowed steps. While it does, one more request may queue (limit 1); a third may not.
    engine = dict(max_num_seqs=1, max_num_batched_tokens=16)
    with live_server(engine=engine, max_queued_requests=1) as live:
        _slow_steps(live, 0.15)
        body = {**LONG, "prompt": "x" * 99, "max_tokens": 1}
        url = f"{live.url}/v1/completions"
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=30)
            deadline = time.monotonic() + 10
            while live.metric("pagedllm:num_requests_running") != 1.0:
                assert time.monotonic() < deadline, "the first request never started its prefill"
                time.sleep(0.02)
            second = pool.submit(httpx.post, url, json=body, timeout=30)
            deadline = time.monotonic() + 10
            while live.metric("pagedllm:num_requests_waiting") != 1.0:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.02)
            third = httpx.post(url, json=body, timeout=30)
            assert third.status_code == 429
            assert first.result().status_code == 200
            assert second.result().status_code == 200


def test_prompts_are_tokenized_off_the_event_loop(server):
    tokenizer = server.engine.tokenizer
    real_encode = tokenizer.encode
    threads = []

    def recording_encode(text):
        threads.append(threading.current_thread().name)
        return real_encode(text)

    tokenizer.encode = recording_encode
    try:
        body = {**LONG, "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
        assert response.status_code == 200
    finally:
        del tokenizer.encode
    assert len(threads) == 2
    assert all(name.startswith("pagedllm-tokenize") for name in threads)


def test_server_start_freezes_the_heap_and_its_stop_unfreezes_it():
    app = build_server_app(ENGINE, ServerConfig(served_model_name=MODEL))
    gc.unfreeze()
    live = LiveServer(app, free_port())
    live.thread.start()
    try:
        deadline = time.monotonic() + 60
        while not live.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.server.started
        assert gc.get_freeze_count() > 100_000  # torch's and the model's objects among them
    finally:
        live.server.should_exit = True
        live.thread.join(timeout=30)
    assert gc.get_freeze_count() == 0


def test_a_second_freeze_frees_the_garbage_the_first_one_kept():
    class Node:
        pass

    gc.unfreeze()
    node = Node()
    node.self = node  # a cycle: only the collector frees it
    alive = weakref.ref(node)
    freeze_heap()
    del node
    gc.collect()
    assert alive() is not None  # frozen: out of the collector's reach
    freeze_heap()
    try:
        assert alive() is None
    finally:
        gc.unfreeze()
