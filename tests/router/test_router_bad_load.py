"""A replica whose /load answers the wrong shape (a wrong type, a missing field, not an object)
counts as failing its polls: it leaves rotation and comes back once it answers properly. Its
poll loop never ends over it, and the router still stops on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest
from fake_replica import GOOD_LOAD, FakeReplica
from router_util import routed, wait_for
from test_replicas import load, polled

from pagedllm.router.replicas import ReplicaSet

from server_util import free_port, wait_healthy

WRONG_SHAPES = {
    "kv_usage a string": load(kv_usage="x"),
    "kv_usage null": load(kv_usage=None),
    "num_running a string": load(num_running="2"),
    "num_waiting negative": load(num_waiting=-1),
    "num_waiting a boolean": load(num_waiting=True),
    "instance_id a number": load(instance_id=7),
    "lora_ids a list": load(lora_ids=["a"]),
    "kv_events a string": load(kv_events="tcp://x:1"),
    "kv_events endpoint a number": load(kv_events={"endpoint": 5}),
    "block_size a string": load(block_size="16"),
    "num_running missing": {"instance_id": "one", "num_waiting": 1, "kv_usage": 0.5},
    "a list": [1, 2, 3],
    "a string": "ok",
}


@pytest.mark.parametrize("answer", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_a_load_answer_of_the_wrong_shape_takes_the_replica_out_until_it_answers_properly(answer):
    replicas = ReplicaSet(["http://r0"], block_size=16, policy="cache_aware")
    polled(replicas, [load(), answer, answer])
    assert not replicas.replicas[0].alive
    assert replicas.stats()[0]["running"] == 2  # the good answer's, never the bad one's
    polled(replicas, [load()])
    assert replicas.replicas[0].alive


def test_the_poll_loop_outlives_a_bad_answer_and_brings_the_replica_back(tmp_path):
    fake = FakeReplica(tmp_path, "a")
    try:
        with routed([fake.url]) as (_, state):
            fake.set_load({**GOOD_LOAD, "kv_usage": "x"})
            wait_for(lambda: not state.replicas[0].alive, what="the replica to leave rotation")
            fake.set_load(GOOD_LOAD)
            wait_for(lambda: state.replicas[0].alive, what="the replica to come back")
    finally:
        fake.close()


def test_a_router_whose_replica_answers_a_bad_load_stops_cleanly_on_sigterm(tmp_path):
    # its KV events subscribed to first (a subscriber thread to stop), then a wrong type
    events = {"endpoint": f"ipc://{tmp_path}/pub", "replay_endpoint": f"ipc://{tmp_path}/rep"}
    good = {**GOOD_LOAD, "block_size": 16, "kv_events": events}
    fake = FakeReplica(tmp_path, "a", load=good)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedllm.cli", "router", "--replica", fake.url]
    cmd += ["--port", str(port), "--block-size", "16", "--health-interval", "0.1"]
    log = tmp_path / "router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url)
        fake.set_load(json.dumps({**good, "kv_usage": "x"}))

        def out_of_rotation() -> bool:
            return httpx.get(f"{url}/health", timeout=5).status_code == 503

        wait_for(out_of_rotation, what="the replica to leave rotation")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "shutdown failed" not in log.read_text()  # its polls and subscriber stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        fake.close()
