"""`KVEventSubscriber`: one replica's KV events into a router's index, on a thread of its own.

It reads the PUB socket and hands each batch to the index (`apply`); a batch whose sequence
number skips ahead (batches were lost) makes it ask the replay socket for the missing ones, or
for a snapshot when the replica no longer holds them (a replay answer that does not start where
it was asked to is a snapshot). `resync()` asks for a replay from the index's next number at
the next turn (a replica that came back).

Nothing a publisher sends ends the subscriber: every message is checked before it is used (its
frames and sequence number here, the batch and each event field by field by the Rust decoder,
which returns the arrays the index applies: no Python object per block), and one that is not a
KV-event message is skipped and counted (`malformed`), its sequence number left to the real
batch; the replica's own answer to a replay is kept in sequence even when malformed (as an empty
batch: asking again would get the same). Should the thread's loop fail all the same, it starts
over on new sockets, caught up by a replay, and counts it (`restarts`); `revive()` starts a new
thread for one that ended anyway."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import zmq

from pagedllm._core import kv_event_index_records
from pagedllm.kv_events.foreign import ForeignHashes

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_MS = 1000
# a failed loop starts over after this long (a failure that repeats does not spin)
RESTART_DELAY_S = 0.5
# malformed messages are logged at most once per this many seconds (a flood is one line)
MALFORMED_LOG_EVERY_S = 10.0


class MalformedBatch(ValueError):
    """A KV-event message or batch that is not one (what is wrong, named)."""


def index_records(
    payload: bytes, foreign: ForeignHashes | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A msgpack KVEventBatch -> (kinds uint8, starts uint32, hashes uint64, media uint8), the
    arrays the router core applies, decoded in Rust (`kv_event_index_records`: events of
    unknown kinds skipped). With `foreign` (another engine's events), the blocks are re-hashed
    into this router's hashes and the changes staged there (`commit` or `rollback` next);
    without it, hashes that are not integers are skipped. MalformedBatch (a ValueError) naming
    what is wrong for a payload that is not a batch: nothing is staged then."""
    try:
        return kv_event_index_records(payload, foreign)
    except ValueError as exc:
        raise MalformedBatch(str(exc)) from None


def decode_batch(
    payload: bytes, foreign: ForeignHashes | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`index_records` without the media: (kinds, starts, hashes)."""
    return index_records(payload, foreign)[:3]


def message_seq(frames: list[bytes]) -> int:
    """The sequence number of a PUB message `(topic, seq as 8 bytes, payload)`; MalformedBatch
    for a message of another shape or a negative number."""
    if len(frames) != 3:
        raise MalformedBatch(f"a message of {len(frames)} frames, not 3")
    if len(frames[1]) != 8:
        raise MalformedBatch(f"a sequence number of {len(frames[1])} bytes, not 8")
    seq = int.from_bytes(frames[1], "big", signed=True)
    if seq < 0:
        raise MalformedBatch(f"sequence number {seq}")
    return seq


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
        self.malformed = 0  # messages skipped as not KV-event messages
        self.restarts = 0  # times the loop failed and started over (or `revive` restarted it)
        self._next_warning = 0.0
        self._resync = threading.Event()
        self._resync.set()  # a new subscriber catches up from the start
        self._restarted = threading.Event()
        self._stop = threading.Event()
        self._thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"kv-events-{self.replica}", daemon=True)

    def start(self) -> KVEventSubscriber:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def revive(self) -> bool:
        """Starts a new thread when the last one ended without `close()` (True then): counted
        in `restarts`, caught up by a replay."""
        if self._stop.is_set() or self._thread.ident is None or self._thread.is_alive():
            return False
        self.restarts += 1
        logger.error(
            "replica %d: the KV-event subscriber had stopped; started again (restart %d)",
            self.replica,
            self.restarts,
        )
        self._resync.set()
        self._thread = self._new_thread()
        self._thread.start()
        return True

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
        while not self._stop.is_set():
            try:
                self._serve()
            except Exception:  # noqa: BLE001 - whatever it was, the subscriber goes on
                if self._stop.is_set():
                    return
                self.restarts += 1
                logger.exception(
                    "replica %d: the KV-event subscriber failed; starting over (restart %d)",
                    self.replica,
                    self.restarts,
                )
                self._resync.set()  # what was missed meanwhile comes by replay
                self._stop.wait(RESTART_DELAY_S)

    def _serve(self) -> None:
        """Reads until `close()`, on sockets of its own (closed however it ends)."""
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        replay = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.DEALER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.connect(self.replay_endpoint)
            while not self._stop.is_set():
                if self._restarted.is_set() and self.foreign is not None:
                    self.foreign.reset()  # on this thread: the table is the subscriber's
                self._restarted.clear()
                if self._resync.is_set() and replay is not None and self._replay(replay):
                    self._resync.clear()
                if sub.poll(100):
                    self._on_message(sub.recv_multipart())
        finally:
            sub.close(0)
            if replay is not None:
                replay.close(0)
            ctx.term()

    def _on_message(self, frames: list[bytes]) -> None:
        """One live message, checked; one that is not a batch is skipped and counted."""
        try:
            seq = message_seq(frames)
            self._apply(seq, frames[2])
        except MalformedBatch as exc:
            self._skip(exc)
        except Exception as exc:  # noqa: BLE001 - an input this code did not foresee
            logger.exception("replica %d: a KV-event message could not be used", self.replica)
            self._skip(exc)

    def _skip(self, reason: Exception) -> None:
        self.malformed += 1
        if self.foreign is not None:
            self.foreign.rollback()
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + MALFORMED_LOG_EVERY_S
            logger.warning(
                "replica %d: a malformed KV-event message skipped (%d so far): %s",
                self.replica,
                self.malformed,
                reason,
            )

    def _apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        """Batch `seq` into the index. MalformedBatch for a payload that is not a batch: live,
        it is left out of the sequence (a real batch `seq` may follow; if not, the next one is a
        gap); `replayed` (the replica's own answer), it is kept in sequence as an empty batch."""
        try:
            kinds, starts, hashes, media = index_records(payload, self.foreign)
        except MalformedBatch as exc:
            if not replayed:
                raise
            self._skip(exc)
            kinds, starts = np.array([], np.uint8), np.array([0], np.uint32)
            hashes, media = np.array([], np.uint64), None
        with self.lock:
            status = self.index.apply_events(self.replica, seq, kinds, starts, hashes, media)
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
            if len(frames) < 2 or len(frames[-2]) != 8:
                self._skip(MalformedBatch(f"a replay answer of {len(frames)} frames"))
                continue
            seq_bytes, payload = frames[-2], frames[-1]
            if not payload:  # the end marker
                self.replays += 1
                return True
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            try:
                if first and seq != start and self.foreign is not None:
                    self._restart_at(seq, payload)
                elif first and seq != start:
                    self._snapshot(seq, payload)
                elif seq < 0:
                    raise MalformedBatch(f"replayed sequence number {seq}")
                else:
                    self._apply(seq, payload, replayed=True)
            except MalformedBatch as exc:
                self._skip(exc)
            first = False
        return False  # the replica does not answer: asked again next turn

    def _restart_at(self, seq: int, payload: bytes) -> None:
        """The replica's part of the index emptied and `seq` applied as its next batch (another
        engine's replay starts with the oldest batch it still holds, not a snapshot)."""
        if seq < 0:
            raise MalformedBatch(f"sequence number {seq}")
        if self.foreign is not None:
            self.foreign.reset()
        with self.lock:
            if seq <= 0:
                self.index.reset_replica(self.replica)
            else:
                self.index.apply_snapshot(self.replica, seq - 1, np.array([], np.uint64))
        self._apply(seq, payload, replayed=True)

    def _snapshot(self, seq: int, payload: bytes) -> None:
        # [AllBlocksCleared, BlockStored(every cached block) per medium]: its hashes are the
        # cache, each on its record's medium
        _, starts, hashes, media = index_records(payload)
        with self.lock:
            if seq < 0:  # the replica has sent nothing yet
                self.index.reset_replica(self.replica)
            else:
                per_hash = np.repeat(media, np.diff(starts))
                self.index.apply_snapshot(self.replica, seq, hashes, per_hash)
        self.batches += 1
