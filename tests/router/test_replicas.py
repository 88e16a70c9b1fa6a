"""The router's view of its replicas from their `GET /load` (httpx's mock transport stands in
for them): unhealthy or silent replicas leave rotation, a restarted one's index part is reset,
wildcard event endpoints are reached at the replica's host."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from pagedllm.router.replicas import ReplicaSet, connect_endpoint


def load(**extra) -> dict:
    return {"instance_id": "one", "num_waiting": 1, "num_running": 2, "kv_usage": 0.5, **extra}


def polled(replicas: ReplicaSet, answers: list) -> None:
    """Polls once per answer (a dict: that /load; an int: that status; an exception: raised)."""

    async def run() -> None:
        answer = iter(answers)

        def handler(request: httpx.Request) -> httpx.Response:
            a = next(answer)
            if isinstance(a, Exception):
                raise a
            return httpx.Response(a, json={}) if isinstance(a, int) else httpx.Response(200, json=a)

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for _ in answers:
                await replicas.poll(client)

    asyncio.run(run())


def test_a_replica_reporting_an_unhealthy_engine_leaves_rotation():
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    polled(replicas, [load(healthy=False), load(healthy=False)])
    assert not replicas.replicas[0].alive
    polled(replicas, [load(healthy=True)])
    assert replicas.replicas[0].alive


def test_one_failed_poll_is_forgiven_two_are_not():
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    polled(replicas, [500, load(), 500])
    assert replicas.replicas[0].alive
    polled(replicas, [500])
    assert not replicas.replicas[0].alive


def test_a_new_instance_id_resets_the_replicas_part_of_the_index():
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    polled(replicas, [load()])
    kinds, starts = np.array([0], np.uint8), np.array([0, 2], np.uint32)
    replicas.router.apply_events(0, 0, kinds, starts, np.array([5, 6], np.uint64))
    polled(replicas, [load(instance_id="two")])
    assert replicas.router.replica_hashes(0).size == 0
    assert replicas.router.next_seq(0) == 0
    assert replicas.stats()[0]["waiting"] == 1


def test_wildcard_event_endpoints_are_reached_at_the_replicas_host():
    assert connect_endpoint("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert connect_endpoint("tcp://0.0.0.0:5558", "http://h:1") == "tcp://h:5558"
    assert connect_endpoint("ipc:///tmp/x", "http://h:1") == "ipc:///tmp/x"


def test_a_slow_but_alive_replica_stays_in_rotation():
    # polls that time out while the replica answered within the bound: busy, not dead
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    slow = httpx.ReadTimeout("busy")
    polled(replicas, [load(), slow, slow, slow])
    assert replicas.replicas[0].alive


def test_a_replica_silent_past_the_bound_leaves_rotation():
    replicas = ReplicaSet(
        ["http://r0"], block_size=16, policy="cache_aware", unresponsive_after=0.2
    )
    polled(replicas, [load()])
    time.sleep(0.25)
    polled(replicas, [httpx.ReadTimeout("busy")])
    assert not replicas.replicas[0].alive


def test_a_hung_replicas_poll_ends_at_the_bound_and_takes_it_out():
    replicas = ReplicaSet(
        ["http://r0"], block_size=16, policy="cache_aware", unresponsive_after=0.3
    )
    polled(replicas, [load()])

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(3600)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(hang)) as client:
            await asyncio.wait_for(replicas.poll(client), 5.0)

    asyncio.run(run())  # ends (wait_for's 5 s is only the test's guard against a hang)
    assert not replicas.replicas[0].alive


def test_unresponsive_after_must_be_positive():
    with pytest.raises(ValueError, match="unresponsive_after"):
        ReplicaSet(["http://r0"], block_size=16, policy="cache_aware", unresponsive_after=0)
