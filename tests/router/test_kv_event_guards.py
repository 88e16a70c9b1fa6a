"""The router's guards on its replicas' KV events: a subscriber thread that ended is revived by
the next poll and counted on /metrics with the malformed messages it skipped, and each replica's
part of the index is bounded (forged events cannot grow it without end)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_replicas import load, polled

from pagedllm._core import Router
from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.publisher import KVEventPublisher
from pagedllm.router.app import build_router_app
from pagedllm.router.replicas import ReplicaSet


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def publishing(tmp_path):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
    )
    publisher = KVEventPublisher(config, 16)
    yield {k: v for k, v in vars(config).items() if k in ("endpoint", "replay_endpoint")}
    publisher.close()


# the thread is ended on purpose (SystemExit), which pytest's thread hook reports
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_subscriber_is_revived_by_the_poll_and_counted_on_metrics(publishing):
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    answer = load(block_size=16, kv_events=publishing)
    polled(replicas, [answer])
    sub = replicas.replicas[0].subscriber
    # caught up: the first replay answered and its request cleared (a resync asked before the
    # clear would be lost with it)
    wait_for(lambda: sub.replays == 1 and not sub._resync.is_set())
    sub._on_message([b"", b"\x00" * 8])  # a malformed message: counted
    replay = sub._replay

    def ends_thread(sock):
        sub._replay = replay
        raise SystemExit

    sub._replay = ends_thread
    sub.resync()
    wait_for(lambda: not sub.is_alive())
    polled(replicas, [answer])
    try:
        assert replicas.replicas[0].subscriber is sub and sub.is_alive()
        text = metrics(replicas)
        assert 'pagedllm_router:kv_events_malformed_total{engine="0"} 1.0' in text
        assert 'pagedllm_router:kv_event_subscriber_restarts_total{engine="0"} 1.0' in text
    finally:
        sub.close()


def metrics(replicas: ReplicaSet) -> str:
    """/metrics without the app's lifespan: its poll would look the made-up replica's host name
    up on the network, and where the resolver never answers, the event loop's shutdown waits on
    the lookup's thread without end."""
    return TestClient(build_router_app(replicas)).get("/metrics").text


def stored(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array([0], np.uint8), np.array([0, len(hashes)], np.uint32), hashes


def test_forged_blocks_past_a_replicas_bound_are_dropped_and_counted():
    router = Router(2, 16)
    router.set_index_capacity(0, 1000)
    forged = np.arange(1, 100_001, dtype=np.uint64)
    assert router.apply_events(0, 0, *stored(forged)) == -1
    assert len(router.replica_hashes(0)) == 1000
    s = router.stats()[0]
    assert (s["indexed_blocks"], s["index_capacity"], s["dropped_blocks"]) == (1000, 1000, 99_000)
    # the other replica's part is bounded on its own
    assert router.apply_events(1, 0, *stored(forged[:10])) == -1
    assert len(router.replica_hashes(1)) == 10


def test_an_unset_bound_is_the_default_cap():
    router = Router(1, 16)
    assert router.stats()[0]["index_capacity"] == 1 << 20
    many = np.arange(1, (1 << 20) + 11, dtype=np.uint64)
    router.apply_events(0, 0, *stored(many))
    assert router.stats()[0]["dropped_blocks"] == 10


def test_the_subscriber_thread_is_left_alone_while_it_runs(publishing):
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    answer = load(block_size=16, kv_events=publishing)
    polled(replicas, [answer, answer])
    sub = replicas.replicas[0].subscriber
    try:
        assert sub.is_alive() and sub.restarts == 0
    finally:
        sub.close()


def test_a_replicas_index_is_bounded_by_the_cache_size_it_reports():
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    polled(replicas, [load(num_gpu_blocks=300)])
    assert replicas.router.stats()[0]["index_capacity"] == 600  # twice its cache's blocks


def test_a_wrong_typed_cache_size_in_load_takes_the_replica_out():
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    polled(replicas, [load(num_gpu_blocks="many")] * 3)
    assert not replicas.replicas[0].alive
