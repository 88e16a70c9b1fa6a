"""`KVEventsConfig`: the `--kv-events-config` JSON, with vLLM's field names."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

PUBLISHERS = ("null", "zmq")
MAX_PORT = 65535


@dataclass(frozen=True)
class KVEventsConfig:
    """Where an engine publishes its KV events (vLLM's `KVEventsConfig`).

    `endpoint` is bound by the PUB socket, `replay_endpoint` (None: no replay) by the ROUTER
    socket that answers a subscriber's "replay from sequence number N" with the batches it still
    holds (`buffer_steps` of them), or with a snapshot of the whole cache when N is older than
    those. Under data parallelism replica r binds each TCP port + r (vLLM's rule).

    Neither socket asks who connects, and each `BlockStored` carries the prompt's token ids: so
    the default endpoint is on loopback (vLLM's is every interface), binding another address
    logs a warning (`publisher.exposure`), and `hashes_only` publishes the blocks' hashes without
    their tokens (what a pagedllm router needs; a router re-hashing another engine's events, or
    an indexer like llm-d's, needs the tokens)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""
    hashes_only: bool = False

    @classmethod
    def from_dict(cls, value: dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """None for no config; a bad field or value is a ValueError naming it."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown field(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(names))})"
            )
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("enable_kv_cache_events", "hashes_only"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv_events_config.{name} must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {list(PUBLISHERS)}, "
                f"got {self.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint", "topic"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"kv_events_config.{name} must be a string, got {value!r}")
        for name in ("buffer_steps", "hwm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"kv_events_config.{name} must be a positive integer, got {value!r}"
                )

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The endpoints of data-parallel replica `rank`: each TCP port + rank."""
        if rank == 0:
            return self
        return dataclasses.replace(
            self,
            endpoint=offset_port(self.endpoint, rank),
            replay_endpoint=offset_port(self.replay_endpoint, rank),
        )


def offset_port(endpoint: str | None, offset: int) -> str | None:
    """`tcp://host:port` with port + offset; other transports unchanged (ipc/inproc: + suffix).
    ValueError when the port would pass 65535 (too many data-parallel ranks above it)."""
    if endpoint is None:
        return None
    match = re.fullmatch(r"(tcp://.+):(\d+)", endpoint)
    if match:
        port = int(match.group(2)) + offset
        if port > MAX_PORT:
            raise ValueError(
                f"kv_events_config: {endpoint} + {offset} (data-parallel replica {offset}'s port, "
                f"each TCP port + its rank) passes port {MAX_PORT}; give a lower port or fewer "
                "replicas (--data-parallel-size)"
            )
        return f"{match.group(1)}:{port}"
    return f"{endpoint}-{offset}"
