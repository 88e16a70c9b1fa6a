"""The subscriber keeps a router index equal to a replica's cache: batches lost on the way are
replayed, and a replica that no longer holds them answers with a snapshot."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pagedllm._core import Router, Scheduler
from pagedllm.kv_events import KVEventsConfig
from pagedllm.kv_events.foreign import ForeignHashes
from pagedllm.kv_events.publisher import KVEventPublisher
from pagedllm.kv_events.subscriber import KVEventSubscriber, decode_batch

BLOCK = 4


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class Replica:
    """A scheduler whose every step publishes its KV events (what an engine does)."""

    def __init__(self, folder, buffer_steps: int = 10_000) -> None:
        self.config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{folder}/pub",
            replay_endpoint=f"ipc://{folder}/replay",
            buffer_steps=buffer_steps,
        )
        self.publisher = KVEventPublisher(self.config, BLOCK)
        self.scheduler = Scheduler(block_size=BLOCK, num_gpu_blocks=12, max_model_len=64)
        self.scheduler.set_kv_events(True)
        self.count = 0
        self.cached: set[int] = set()  # what the scheduler's events add up to

    def serve(self, prompt: list[int], max_tokens: int = 3) -> None:
        self.count += 1
        self.scheduler.add_request(f"r{self.count}", prompt, max_tokens=max_tokens)
        while self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            self.scheduler.update_from_output(out, np.full(out.num_samples, 7, np.int64))
            events = self.scheduler.drain_kv_events()
            self.note(events)
            self.publisher.publish(events)

    def note(self, events) -> None:
        """Applies a step's events (stored 0, removed 1, all cleared 2) to `cached`."""
        kinds, starts, _parents, _extra_keys, hashes, _tokens = events
        for kind, start, end in zip(kinds.tolist(), starts[:-1].tolist(), starts[1:].tolist()):
            if kind == 0:
                self.cached.update(hashes[start:end].tolist())
            elif kind == 1:
                self.cached.difference_update(hashes[start:end].tolist())
            else:
                self.cached.clear()

    def cache(self) -> list[int]:
        return sorted(self.cached)


def subscriber(replica: Replica, index: Router, drop: set[int], **kwargs) -> KVEventSubscriber:
    """A subscriber whose live socket loses the batches numbered in `drop` (once each)."""
    sub = KVEventSubscriber(
        index,
        threading.Lock(),
        0,
        replica.config.endpoint,
        replica.config.replay_endpoint,
        **kwargs,
    )
    apply = sub._apply

    def lossy(seq: int, payload: bytes, **kwargs) -> None:
        if seq in drop:
            drop.discard(seq)
            return
        apply(seq, payload, **kwargs)

    sub._apply = lossy
    return sub


def indexed(index: Router) -> list[int]:
    return sorted(index.replica_hashes(0).tolist())


@pytest.mark.parametrize("rehashed", [False, True], ids=["own-hashes", "rehashed-as-foreign"])
def test_a_lost_batch_is_replayed_and_the_index_matches_the_cache(tmp_path, rehashed):
    # rehashed: the events read as another engine's (kv_events/foreign.py); pagedllm's carry the
    # tokens beside its hashes, so re-hashing them must give the very hashes its cache holds
    replica = Replica(tmp_path)
    index = Router(1, BLOCK)
    foreign = ForeignHashes(BLOCK) if rehashed else None
    sub = subscriber(replica, index, drop={2}, foreign=foreign).start()
    try:
        wait_for(lambda: sub.replays == 1)  # the first catch-up, from 0
        time.sleep(0.2)  # the SUB socket's subscription reaches the publisher
        for start in range(0, 60, 12):  # several prompts: stores and (12 blocks) evictions
            replica.serve(list(range(start, start + 9)))
        wait_for(lambda: index.next_seq(0) == replica.publisher.seq + 1)
        assert sub.replays >= 2, "the gap was replayed"
        assert indexed(index) == replica.cache()
    finally:
        sub.close()
        replica.publisher.close()


def test_a_gap_older_than_the_replay_buffer_is_rebuilt_from_a_snapshot(tmp_path):
    replica = Replica(tmp_path, buffer_steps=1)
    for start in range(0, 36, 12):  # batches the subscriber never sees
        replica.serve(list(range(start, start + 9)))
    index = Router(1, BLOCK)
    sub = subscriber(replica, index, drop=set()).start()
    try:
        wait_for(lambda: sub.replays == 1)
        assert index.next_seq(0) == replica.publisher.seq + 1
        assert indexed(index) == replica.cache()
    finally:
        sub.close()
        replica.publisher.close()


def test_decode_batch_skips_unknown_events_and_non_integer_hashes():
    import msgpack

    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [1, b"x", 2], None, [], 4, None, None],
                ["Weird"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    kinds, starts, hashes = decode_batch(payload)
    assert kinds.tolist() == [0, 2]
    assert starts.tolist() == [0, 2, 2]
    assert hashes.tolist() == [1, 2]
