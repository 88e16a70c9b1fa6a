"""Nothing a publisher sends ends the subscriber: each malformed message is skipped and counted,
its sequence number left to the real batch, and the index stays equal to the replica's cache;
a loop that fails anyway starts over (counted), and a thread that ended is revived."""

from __future__ import annotations

import logging
import random
import threading
import time

import msgpack
import pytest
from test_subscriber import Replica, indexed, wait_for

from pagedllm._core import Router
from pagedllm.kv_events.foreign import ForeignHashes
from pagedllm.kv_events.subscriber import KVEventSubscriber


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def batch(*events) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def stored(**fields) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        **fields,
    }


# each kind the issue found killing the subscriber; `next` stands for the sequence number the
# index expects (a malformed batch there must not take it from the real one)
MALFORMED = {
    "two-frames": lambda nxt: [b"", seq8(nxt)],
    "four-frames": lambda nxt: [b"", seq8(nxt), batch(stored()), b"extra"],
    "events-an-int": lambda nxt: [b"", seq8(nxt), msgpack.packb([1.0, 5, 0])],
    "events-nil": lambda nxt: [b"", seq8(nxt), msgpack.packb([1.0, None, 0])],
    "type-a-list": lambda nxt: [b"", seq8(nxt), batch(stored(type=["BlockStored"]))],
    "block-hashes-an-int": lambda nxt: [b"", seq8(nxt), batch(stored(block_hashes=7))],
    "hash-minus-one": lambda nxt: [b"", seq8(nxt), batch(stored(block_hashes=[-1]))],
    "negative-seq": lambda nxt: [b"", seq8(-5), batch(stored())],
}


@pytest.fixture
def live(tmp_path):
    """(replica, index, subscriber, send): a subscriber caught up with a publishing replica;
    `send(frames)` puts raw frames on the replica's PUB socket."""
    replica = Replica(tmp_path)
    index = Router(1, 4)
    sub = KVEventSubscriber(
        index, threading.Lock(), 0, replica.config.endpoint, replica.config.replay_endpoint
    ).start()

    def send(frames: list[bytes]) -> None:
        with replica.publisher._lock:
            replica.publisher._pub.send_multipart(frames)

    try:
        wait_for(lambda: sub.replays == 1)
        time.sleep(0.2)  # the SUB socket's subscription reaches the publisher
        yield replica, index, sub, send
    finally:
        sub.close()
        replica.publisher.close()


def caught_up(replica: Replica, index: Router) -> bool:
    return index.next_seq(0) == replica.publisher.seq + 1 and indexed(index) == replica.cache()


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_message_is_skipped_and_counted_and_the_subscriber_goes_on(live, kind):
    replica, index, sub, send = live
    replica.serve(list(range(0, 9)))
    wait_for(lambda: caught_up(replica, index))
    send(MALFORMED[kind](index.next_seq(0)))
    wait_for(lambda: sub.malformed == 1)
    replica.serve(list(range(20, 29)))  # the real batch at the number the bad one carried
    wait_for(lambda: caught_up(replica, index))
    assert sub.is_alive() and sub.restarts == 0


def random_object(rng: random.Random, depth: int = 0):
    """A random msgpack value (nested up to 3 deep)."""
    kinds = ["int", "neg", "big", "float", "str", "bytes", "nil", "bool"]
    if depth < 3:
        kinds += ["list", "map"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randrange(0, 1 << 16)
    if kind == "neg":
        return -rng.randrange(1, 1 << 63)
    if kind == "big":
        return rng.randrange(0, 1 << 64)
    if kind == "float":
        return rng.uniform(-1e6, 1e6)
    if kind == "str":
        return rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "x"])
    if kind == "bytes":
        return rng.randbytes(rng.randrange(0, 12))
    if kind == "nil":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [random_object(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    keys = ["type", "block_hashes", "token_ids", "events", "ts", rng.randrange(0, 9)]
    return {rng.choice(keys): random_object(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


# per field, values of a type it can never have: a batch carrying one is malformed for sure
WRONG = {
    "type": [["BlockStored"], 5, None, {"a": 1}, 1.5],
    "block_hashes": [7, None, "x", [-1], [1.5], [[1]], [-(1 << 63)], {"a": 1}],
    "parent_block_hash": [-3, 1.5, "x", [1], True],
    "token_ids": [3, None, [-1], ["a"], [1 << 32]],
    "block_size": [0, -4, "x", 1.5, [4]],
    "lora_id": ["x", 1.5, [3]],
    "medium": [3, [1], b"CPU"],
}


def corrupted_batch(rng: random.Random) -> bytes:
    field = rng.choice(list(WRONG))
    event = stored(**{field: rng.choice(WRONG[field])})
    events = [{"type": "BlockRemoved", "block_hashes": [1]}, event]
    rng.shuffle(events)
    return batch(*events)


def junk_message(rng: random.Random, expected: int) -> list[bytes]:
    """A message that is not a KV-event batch, or one at a number no real batch has yet."""
    shape = rng.randrange(4)
    if shape == 0:  # any number of random frames
        return [
            msgpack.packb(random_object(rng)) if rng.random() < 0.5 else rng.randbytes(9)
            for _ in range(rng.randrange(1, 6))
        ]
    if shape == 1:  # at the expected number, a batch with one field of the wrong type
        return [b"", seq8(expected), corrupted_batch(rng)]
    if shape == 2:  # at the expected number, a random value
        payload = random_object(rng)
        if isinstance(payload, list | dict):
            payload = [payload]  # never a batch: `[x]` has no events
        return [b"", seq8(expected), msgpack.packb(payload)]
    # a random number (a gap is replayed, a stale one ignored) with any payload
    return [b"", rng.randbytes(8), msgpack.packb(random_object(rng))]


@pytest.mark.parametrize("rehashed", [False, True], ids=["own-hashes", "rehashed-as-foreign"])
def test_random_messages_never_stop_the_subscriber_nor_change_the_index(tmp_path, rehashed):
    replica = Replica(tmp_path)
    index = Router(1, 4)
    foreign = ForeignHashes(4) if rehashed else None
    sub = KVEventSubscriber(
        index,
        threading.Lock(),
        0,
        replica.config.endpoint,
        replica.config.replay_endpoint,
        foreign=foreign,
    ).start()
    rng = random.Random(20261202)
    try:
        wait_for(lambda: sub.replays == 1)
        for round_ in range(20):
            for _ in range(150):  # 3,000 in all
                frames = junk_message(rng, replica.publisher.seq + 1)
                with replica.publisher._lock:
                    replica.publisher._pub.send_multipart(frames)
            start = 12 * round_
            replica.serve(list(range(start, start + 9)))
        wait_for(lambda: caught_up(replica, index), timeout=30)
        assert sub.is_alive() and sub.restarts == 0
        assert sub.malformed > 1000
    finally:
        sub.close()
        replica.publisher.close()


def test_a_loop_that_fails_starts_over_counted_and_catches_up(live, caplog):
    replica, index, sub, _ = live
    replay = sub._replay

    def fails_once(sock):
        sub._replay = replay
        raise RuntimeError("boom")

    sub._replay = fails_once
    sub.resync()
    with caplog.at_level(logging.ERROR, "pagedllm.kv_events.subscriber"):
        # the subscriber's thread counts the restart just before it logs it: wait for both
        wait_for(lambda: sub.restarts == 1 and "starting over" in caplog.text)
    assert sub.restarts == 1
    replica.serve(list(range(0, 9)))
    wait_for(lambda: caught_up(replica, index))
    assert sub.is_alive()


# the thread is ended on purpose (SystemExit), which pytest's thread hook reports
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_ended_anyway_is_revived_and_counted(live):
    replica, index, sub, _ = live
    assert not sub.revive(), "a running subscriber is left alone"

    def ends_thread(sock):
        raise SystemExit  # not an Exception: the loop does not catch it

    replay = sub._replay
    sub._replay = ends_thread
    sub.resync()
    wait_for(lambda: not sub.is_alive())
    replica.serve(list(range(0, 9)))  # published while no one reads
    sub._replay = replay
    assert sub.revive()
    wait_for(lambda: caught_up(replica, index))
    assert sub.restarts == 1 and sub.is_alive()
