"""Replicas of another engine behind the router (`--external-replica URL EVENTS [REPLAY]`, as a
vLLM server started with --kv-events-config is given): their load is read from Prometheus
/metrics, their KV events re-hashed from the token ids they carry. `pagedllm serve` replicas
given this way stand in for vLLM's here (their /metrics names differ only in the prefix, their
events follow vLLM's schema): the index must still equal each replica's cache."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from router_util import (
    REPLICA_ENGINE,
    build_router_app,
    cached_hashes,
    complete,
    events,
    free_port,
    replica,
    start,
    stop,
    wait_for,
)

from pagedllm.router.replicas import ReplicaSet, external_load

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 7.5
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.78e+09
"""


def test_a_vllm_servers_metrics_give_its_load_identity_and_block_size():
    load = external_load(VLLM_METRICS)
    assert (load["num_running"], load["num_waiting"], load["kv_usage"]) == (3, 3, 0.25)
    assert load["block_size"] == 32
    assert load["instance_id"] == repr(1.78e9)


def test_metrics_without_the_queue_gauges_are_not_an_engines():
    with pytest.raises(ValueError, match="no kv_usage, num_running, num_waiting gauge"):
        external_load("# TYPE up gauge\nup 1.0\n")


def test_an_external_replica_is_polled_on_its_metrics():
    replicas = ReplicaSet(
        [], external=[("http://v0", "tcp://*:5557", None)], block_size=32, policy="cache_aware"
    )
    paths = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, text=VLLM_METRICS)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await replicas.poll(client)

    asyncio.run(run())
    try:
        assert paths == ["/metrics"]
        assert replicas.stats()[0]["waiting"] == 3
        assert replicas.replicas[0].events_key[0] == "tcp://v0:5557"  # subscribed, at its host
    finally:
        asyncio.run(replicas.stop())


def test_a_new_process_start_time_resets_the_replica_and_its_hash_table():
    replicas = ReplicaSet(
        [], external=[("http://v0", "tcp://*:5557", None)], block_size=32, policy="cache_aware"
    )
    answers = iter([VLLM_METRICS, VLLM_METRICS.replace("1.78e+09", "1.79e+09")])

    async def poll() -> None:
        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, text=next(answers))

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await replicas.poll(client)

    try:
        asyncio.run(poll())
        table = replicas.replicas[0].subscriber.foreign
        table.own[11] = 22  # what its events had stored
        kinds, starts = np.array([0], np.uint8), np.array([0, 1], np.uint32)
        replicas.router.apply_events(0, 0, kinds, starts, np.array([22], np.uint64))
        asyncio.run(poll())  # restarted: a new process start time
        assert replicas.router.replica_hashes(0).size == 0
        wait_for(lambda: not table.own, what="the subscriber to empty its table")
    finally:
        asyncio.run(replicas.stop())


@pytest.fixture(scope="module")
def external_cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("events")
    servers = [replica(folder, "a"), replica(folder, "b")]
    given = [
        (s.url, events(folder, name)["endpoint"], events(folder, name)["replay_endpoint"])
        for s, name in zip(servers, "ab")
    ]
    state = ReplicaSet(
        [], external=given, block_size=REPLICA_ENGINE.get("block_size", 16), policy="cache_aware"
    )
    state.health_interval = 0.1
    router = start(build_router_app(state), free_port())
    try:
        yield servers, router, state
    finally:
        stop(router)
        for s in servers:
            stop(s)


def test_the_index_of_external_replicas_equals_their_caches(external_cluster):
    servers, router, state = external_cluster
    for i in range(6):
        assert complete(router.url, f"Distinct prompt number {i} " * 4).status_code == 200
    for live in servers:
        live.wait_idle()

    def matches() -> bool:
        for i, live in enumerate(servers):
            with state.lock:
                ours = sorted(state.router.replica_hashes(i).tolist())
            if ours != cached_hashes(live.engine.engine):
                return False
        return True

    wait_for(matches, what="the index to match the caches")


def test_a_prompt_goes_to_the_external_replica_holding_its_prefix(external_cluster):
    _, router, _ = external_cluster
    prefix = "A long shared system prompt about tide tables and harbours. " * 4
    first = complete(router.url, prefix + "Question one?")
    home = first.headers["x-pagedllm-replica"]
    for n in ("two", "three", "four"):
        again = complete(router.url, prefix + f"Question {n}?")
        assert again.headers["x-pagedllm-replica"] == home
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
