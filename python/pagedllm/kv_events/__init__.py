"""KV events: an engine's prefix-cache changes published per step in vLLM's schema (msgpack over
ZMQ PUB, a sequence number per batch, a replay socket), and the subscriber a router reads them
with. `config` is the `--kv-events-config` knob; the Rust core records and encodes the events."""

from pagedllm.kv_events.config import KVEventsConfig

__all__ = ["KVEventsConfig"]
