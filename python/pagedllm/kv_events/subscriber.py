"""`KVEventSubscriber`: one replica's KV events into a router's index, on a thread of its own.

It reads the PUB socket and hands each batch to the index (`apply`); a batch whose sequence
number skips ahead (batches were lost) makes it ask the replay socket for the missing ones, or
for a snapshot when the replica no longer holds them (a replay answer that does not start where
it was asked to is a snapshot). `resync()` asks for a replay from the index's next number at
the next turn (a replica that came back)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgpack
import numpy as np
import zmq

from pagedllm.kv_events.foreign import ForeignHashes
from pagedllm.kv_events.publisher import CLEARED, REMOVED, STORED

logger = logging.getLogger(__name__)

TAGS = {"BlockStored": STORED, "BlockRemoved": REMOVED, "AllBlocksCleared": CLEARED}
REPLAY_TIMEOUT_MS = 1000


# each event's fields in order, for its array form (what pagedllm sends, vLLM's structs with
# array_like); the map form (vLLM's default) names them, its tag under "type"
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def event_fields(event) -> tuple[str | None, dict]:
    """(tag, fields by name) of one event in either form; (None, {}) for anything else."""
    if isinstance(event, dict):
        return event.get("type"), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        return event[0], dict(zip(_FIELDS.get(event[0], ()), event[1:]))
    return None, {}


def decode_batch(
    payload: bytes, foreign: ForeignHashes | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A msgpack KVEventBatch -> (kinds uint8, starts uint32, hashes uint64), the arrays the
    router core applies. Events of unknown kinds are skipped. With `foreign` (another engine's
    events), the blocks are re-hashed into this router's hashes and the changes staged there
    (`commit` or `rollback` next); without it, hashes that are not integers are skipped.
    ValueError for a payload that is not a batch."""
    try:
        batch = msgpack.unpackb(payload, use_list=True, raw=False)
        events = batch[1] if isinstance(batch, list) else batch["events"]
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch ({exc!r})") from None
    kinds, starts, hashes = [], [0], []
    for event in events:
        tag, fields = event_fields(event)
        kind = TAGS.get(tag)
        if kind is None:
            continue
        block_hashes = fields.get("block_hashes") or []
        if foreign is None:
            if kind != CLEARED:
                hashes.extend(h for h in block_hashes if isinstance(h, int))
        elif kind == STORED:
            hashes.extend(foreign.stored(fields))
        elif kind == REMOVED:
            hashes.extend(foreign.removed(block_hashes))
        else:
            foreign.cleared()
        kinds.append(kind)
        starts.append(len(hashes))
    return (
        np.array(kinds, np.uint8),
        np.array(starts, np.uint32),
        np.array(hashes, np.uint64),
    )


class KVEventSubscriber:
    """Feeds replica `replica`'s events into `index` (anything with `apply_events`,
    `apply_snapshot`, `reset_replica` and `next_seq`, called under `lock`)."""

    def __init__(
        self,
        index,
        lock: threading.Lock,
        replica: int,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        on_batch: Callable[[int], None] | None = None,
        foreign: ForeignHashes | None = None,
    ) -> None:
        self.index = index
        self.lock = lock
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.on_batch = on_batch
        self.foreign = foreign  # another engine's events: re-hashed (`decode_batch`)
        self.batches = 0  # applied, live or replayed
        self.replays = 0  # replay requests answered
        self._resync = threading.Event()
        self._resync.set()  # a new subscriber catches up from the start
        self._restarted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{replica}", daemon=True)

    def start(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def resync(self, restarted: bool = False) -> None:
        """Replays from the index's next number at the next turn; `restarted`: the replica is a
        new process (the index's part was reset), so a foreign table starts empty as well."""
        if restarted:
            self._restarted.set()
        self._resync.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint is not None:
            replay = ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(self.replay_endpoint)
        try:
            while not self._stop.is_set():
                if self._restarted.is_set() and self.foreign is not None:
                    self.foreign.reset()  # on this thread: the table is the subscriber's
                self._restarted.clear()
                if self._resync.is_set() and replay is not None and self._replay(replay):
                    self._resync.clear()
                if not sub.poll(100):
                    continue
                _, seq, payload = sub.recv_multipart()
                self._apply(int.from_bytes(seq, "big", signed=True), payload)
        except zmq.ZMQError:
            if not self._stop.is_set():
                logger.exception("KV-event subscriber %d failed", self.replica)
        finally:
            sub.close(0)
            if replay is not None:
                replay.close(0)
            ctx.term()

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            arrays = decode_batch(payload, self.foreign)
        except ValueError as exc:  # kept in sequence as an empty batch: the next one follows
            logger.warning("replica %d: KV event batch %d skipped: %s", self.replica, seq, exc)
            arrays = np.array([], np.uint8), np.array([0], np.uint32), np.array([], np.uint64)
            if self.foreign is not None:
                self.foreign.rollback()
        with self.lock:
            status = self.index.apply_events(self.replica, seq, *arrays)
        if self.foreign is not None:
            self.foreign.commit() if status == -1 else self.foreign.rollback()
        if status == -1:
            self.batches += 1
            if self.on_batch is not None:
                self.on_batch(self.replica)
        elif status >= 0 and self.replay_endpoint is None:
            # lost batches and no replay to ask: what the replica holds from before is unknown,
            # so its part starts empty at this batch (its prefixes are found again as it stores)
            logger.info("replica %d: KV events %d..%d lost", self.replica, status, seq - 1)
            self._restart_at(seq, payload)
        elif status >= 0:  # lost batches: replay from the one expected
            logger.info(
                "replica %d: KV events %d..%d lost, replaying", self.replica, status, seq - 1
            )
            self._resync.set()

    def _replay(self, sock: zmq.Socket) -> bool:
        """Asks for every batch from the index's next number on; True once answered."""
        with self.lock:
            start = self.index.next_seq(self.replica)
        sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        first = True
        while sock.poll(REPLAY_TIMEOUT_MS):
            frames = sock.recv_multipart()
            seq_bytes, payload = frames[-2], frames[-1]
            if not payload:  # the end marker
                self.replays += 1
                return True
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if first and seq != start and self.foreign is not None:
                self._restart_at(seq, payload)
            elif first and seq != start:
                self._snapshot(seq, payload)
            else:
                self._apply(seq, payload)
            first = False
        return False  # the replica does not answer: asked again next turn

    def _restart_at(self, seq: int, payload: bytes) -> None:
        """The replica's part of the index emptied and `seq` applied as its next batch (another
        engine's replay starts with the oldest batch it still holds, not a snapshot)."""
        if self.foreign is not None:
            self.foreign.reset()
        with self.lock:
            if seq <= 0:
                self.index.reset_replica(self.replica)
            else:
                self.index.apply_snapshot(self.replica, seq - 1, np.array([], np.uint64))
        self._apply(seq, payload)

    def _snapshot(self, seq: int, payload: bytes) -> None:
        # [AllBlocksCleared, BlockStored(every cached block)]: its hashes are the cache
        _, _, hashes = decode_batch(payload)
        with self.lock:
            if seq < 0:  # the replica has sent nothing yet
                self.index.reset_replica(self.replica)
            else:
                self.index.apply_snapshot(self.replica, seq, hashes)
        self.batches += 1
