"""`KVEventPublisher`: an engine's KV events out over ZMQ, one batch per step (vLLM's wire format).

The PUB socket sends `(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)` per step that
changed the prefix cache; the batches are encoded in Rust straight from the step's arrays. The
replay socket (ROUTER) answers `seq` (8 bytes) with every batch from `seq` on that it still
holds, each `(seq, payload)`, then `(-1, b"")`; asked for batches it no longer holds (or for
ones it never sent: the subscriber knew an earlier run of this replica), it sends one snapshot
instead: `(seq of the last batch, [AllBlocksCleared, BlockStored(every cached block)])`.

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
import time
from collections import deque

import numpy as np
import zmq

from pagedllm._core import ROOT_HASH, Router, encode_kv_event_batch, lora_hash_key
from pagedllm.kv_events.config import KVEventsConfig

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
STORED, REMOVED, CLEARED = 0, 1, 2


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
    """Publishes the batches `Scheduler.drain_kv_events` returns; `close()` ends it."""

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
        self.medium = medium
        # vLLM's publisher stamps every batch with its rank, 0 without data parallelism
        self.data_parallel_rank = data_parallel_rank or 0
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
        # what the published events add up to (the cache's contents): the snapshot's source,
        # kept by the router core's index with a single replica
        self._mirror = Router(1, block_size, pending_ttl=0.0)
        self._lora_keys: list[int] = []
        self._lora_ids: list[int] = []
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
        if lora_id and lora_id not in self._lora_ids:
            self._lora_keys.append(lora_hash_key(lora_id))
            self._lora_ids.append(lora_id)

    def publish(self, events: tuple[np.ndarray, ...]) -> None:
        """Sends one step's events (nothing when the step changed nothing)."""
        kinds, starts, parents, extra_keys, hashes, tokens = events
        if not len(kinds):
            return
        if self.config.hashes_only:
            tokens = tokens[:0]
        payload = self._encode(kinds, starts, parents, extra_keys, hashes, tokens)
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._buffer.append((seq, payload))
            self._mirror.apply_events(0, seq, kinds, starts, hashes)
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)

    def _encode(self, kinds, starts, parents, extra_keys, hashes, tokens) -> bytes:
        return encode_kv_event_batch(
            time.time(),
            kinds,
            starts,
            parents,
            extra_keys,
            hashes,
            tokens,
            block_size=self.block_size,
            lora_keys=self._lora_keys,
            lora_ids=self._lora_ids,
            medium=self.medium,
            data_parallel_rank=self.data_parallel_rank,
        )

    def _snapshot(self) -> bytes:
        """The cache's contents as one batch: cleared, then every block stored (no tokens)."""
        hashes = self._mirror.replica_hashes(0)
        return self._encode(
            np.array([CLEARED, STORED], np.uint8),
            np.array([0, 0, len(hashes)], np.uint32),
            np.array([ROOT_HASH, ROOT_HASH], np.uint64),
            np.zeros(2, np.uint64),
            hashes,
            np.zeros(0, np.uint32),
        )

    def replay_from(self, start: int) -> list[tuple[int, bytes]]:
        """What a replay request for `start` is answered with (before the end marker)."""
        with self._lock:
            oldest = self._buffer[0][0] if self._buffer else self._seq + 1
            if oldest <= start <= self._seq + 1:
                return [(s, p) for s, p in self._buffer if s >= start]
            return [(self._seq, self._snapshot())]

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
