"""`KVEventPublisher`: an engine's KV events out over ZMQ, one batch per step (vLLM's wire format).

The PUB socket sends `(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)` per step that
changed the prefix cache or the offload tier (each record's `medium`: the device cache's, `CPU`
for the host tier, `STORAGE` for the disk tier); Rust drains, encodes and keeps the blocks the
events add up to (`KvEventStream`), so no event crosses into Python one by one. The
replay socket (ROUTER) answers `seq` (8 bytes) with every batch from `seq` on that it still
holds, each `(seq, payload)`, then `(-1, b"")`; asked for batches it no longer holds (or for
ones it never sent: the subscriber knew an earlier run of this replica), it sends one snapshot
instead: `(seq of the last batch, [AllBlocksCleared, BlockStored(every cached block), and one
BlockStored per offload tier holding blocks])`.

Neither socket authenticates, and the stream holds every prompt's token ids (unless
`hashes_only`): a TCP address other than loopback is bound with a warning saying so, and an ipc
socket's file is made the owner's alone (0600; the folder it is in is the caller's to keep
private, as `serve -dp`'s is).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
from collections import deque

import numpy as np
import zmq

from pagedllm._core import KvEventStream
from pagedllm.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def exposure(endpoint: str) -> str | None:
    """Who besides this machine's users can reach `endpoint`: None for loopback, ipc and
    inproc; else what to say in the warning (every interface, or the address named)."""
    match = re.fullmatch(r"tcp://(.+):(\d+|\*)", endpoint)
    if match is None:
        return None
    host = match.group(1).strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        return "every network interface"
    if host == "localhost":
        return None
    try:
        return None if ipaddress.ip_address(host).is_loopback else f"address {host}"
    except ValueError:  # an interface or host name
        return f"interface {host}"


def bind_private(sock: zmq.Socket, endpoint: str, what: str) -> None:
    """Binds `endpoint`; a filesystem ipc socket is made 0600, a TCP one off loopback warned of."""
    sock.bind(endpoint)
    path = endpoint.removeprefix("ipc://")
    if endpoint.startswith("ipc://") and not path.startswith("@"):
        os.chmod(path, 0o600)
    reach = exposure(endpoint)
    if reach is not None:
        logger.warning(
            "KV events: the %s socket %s is open to %s without authentication; anyone who "
            "reaches it reads every prompt's token ids (bind 127.0.0.1, or set hashes_only)",
            what,
            endpoint,
            reach,
        )


class KVEventPublisher:
    """Publishes a scheduler's KV events once per step (`publish_step`); `close()` ends it."""

    def __init__(
        self,
        config: KVEventsConfig,
        block_size: int,
        *,
        medium: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        # encodes the steps and keeps the snapshot's blocks; vLLM's publisher stamps every
        # batch with its rank, 0 without data parallelism
        self._stream = KvEventStream(
            block_size,
            medium=medium,
            data_parallel_rank=data_parallel_rank or 0,
            hashes_only=config.hashes_only,
        )
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            bind_private(self._pub, config.endpoint, "events")
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                bind_private(self._replay, config.replay_endpoint, "replay")
        except (zmq.ZMQError, OSError) as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {exc}") from None
        self._lock = threading.Lock()
        self._seq = -1
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replay, name="kv-events-replay", daemon=True
            )
            self._thread.start()

    @property
    def seq(self) -> int:
        """Sequence number of the last batch sent (-1: none yet)."""
        return self._seq

    def note_lora(self, lora_id: int) -> None:
        """Blocks of adapter `lora_id` report it as their `lora_id`."""
        self._stream.note_lora(lora_id)

    def publish_step(self, scheduler) -> None:
        """Sends the events of `scheduler`'s last step, its prefix cache's and its offload
        tier's (nothing when the step changed nothing)."""
        with self._lock:
            self._send(self._stream.publish_step(scheduler))

    def publish(self, events: tuple[np.ndarray, ...]) -> None:
        """`publish_step` for a step's arrays already drained (`Scheduler.drain_kv_events`)."""
        with self._lock:
            self._send(self._stream.publish(events))

    def _send(self, payload: bytes | None) -> None:
        if payload is None:
            return
        self._seq += 1
        self._buffer.append((self._seq, payload))
        self._pub.send_multipart((self._topic, seq_bytes(self._seq), payload), copy=False)

    def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        """What a replay request for `start` is answered with (before the end marker)."""
        with self._lock:
            oldest = self._buffer[0][0] if self._buffer else self._seq + 1
            if oldest <= start <= self._seq + 1:
                return [(s, p) for s, p in self._buffer if s >= start]
            return [(self._seq, self._stream.snapshot())]

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._replay.recv_multipart()
            # REQ and DEALER(+ empty delimiter) clients both arrive as [identity, b"", start]
            identity, start = frames[0], frames[-1]
            if len(start) != 8:
                continue
            for seq, payload in self.replay_from(int.from_bytes(start, "big", signed=True)):
                self._replay.send_multipart((identity, b"", seq_bytes(seq), payload))
            self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
