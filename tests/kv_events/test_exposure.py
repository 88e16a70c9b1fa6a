"""KV events carry every prompt's token ids and no socket asks who connects: the default
endpoint is loopback, any other TCP address is bound with a warning, an ipc socket is its
owner's alone, and `hashes_only` publishes the blocks without their tokens."""

from __future__ import annotations

import logging
import os
import socket
import stat
import time

import msgpack
import numpy as np
import pytest
import zmq

from pagedllm._core import Scheduler
from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.publisher import KVEventPublisher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publisher(endpoint: str, **extra) -> KVEventPublisher:
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, **extra
    )
    return KVEventPublisher(config, 4)


def test_the_default_endpoint_is_loopback_only():
    default = KVEventsConfig().endpoint
    assert default == "tcp://127.0.0.1:5557"
    # the default address on a free port: bound on loopback only
    pub = publisher(default.rsplit(":", 1)[0] + f":{free_port()}")
    try:
        bound = pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        assert bound.startswith("tcp://127.0.0.1:")
    finally:
        pub.close()


@pytest.mark.parametrize("host", ["*", "0.0.0.0"])
def test_a_wildcard_address_is_bound_with_a_warning(host, caplog):
    with caplog.at_level(logging.WARNING, "pagedllm.kv_events.publisher"):
        publisher(f"tcp://{host}:{free_port()}").close()
    assert "every network interface without authentication" in caplog.text


def test_loopback_and_ipc_are_bound_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "pagedllm.kv_events.publisher"):
        publisher(f"tcp://127.0.0.1:{free_port()}").close()
        publisher(f"ipc://{tmp_path}/pub").close()
    assert caplog.text == ""


def test_an_ipc_socket_is_its_owners_alone(tmp_path):
    pub = publisher(f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay")
    try:
        for name in ("pub", "replay"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    finally:
        pub.close()


def test_hashes_only_publishes_blocks_without_their_tokens(tmp_path):
    pub = publisher(f"ipc://{tmp_path}/pub", hashes_only=True)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/pub")
    try:
        time.sleep(0.2)  # the subscription reaches the publisher
        scheduler = Scheduler(block_size=4, num_gpu_blocks=8, max_model_len=32)
        scheduler.set_kv_events(True)
        scheduler.add_request("r", list(range(10, 19)), max_tokens=1)
        out = scheduler.schedule()
        scheduler.update_from_output(out, np.full(out.num_samples, 7, np.int64))
        pub.publish(scheduler.drain_kv_events())
        assert sub.poll(2000)
        event = msgpack.unpackb(sub.recv_multipart()[2])[1][0]
        assert event["type"] == "BlockStored" and len(event["block_hashes"]) == 2
        assert event["token_ids"] == []
    finally:
        sub.close()
        pub.close()


def test_hashes_only_must_be_a_boolean():
    with pytest.raises(ValueError, match="hashes_only must be true or false"):
        KVEventsConfig.from_dict({"hashes_only": "yes"})
