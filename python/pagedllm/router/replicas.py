"""The replicas as the router knows them: the Rust `Router` (prefix index, load, policies) behind
one lock, a KV-event subscriber per replica, and the health poll that takes a replica out of
rotation when it stops answering and back in (resynced) when it answers again.

A replica that stops answering altogether (a frozen or hung process: no reply, no reset) has
its requests under way ended when it leaves rotation (`InFlight`): nothing else would end them.
A replica refusing connections (dead, or draining on shutdown) or answering errors leaves
rotation too, but what it has under way ends by itself (its connections close, or it finishes).
A /load answer of the wrong shape counts as a failed poll; nothing a replica answers ends its
poll loop. A new `instance_id` (a restarted process) is counted (`restarts`) and resets its part
of the index, rebuilt from the new instance's events.

A `pagedllm serve` replica reports its load, identity and KV-event endpoints on GET /load. An
external one (a vLLM server started with `--kv-events-config`) is given with its events endpoint;
its load comes from its Prometheus /metrics (`vllm:num_requests_waiting`, `..._running`,
`kv_cache_usage_perc`; the `pagedllm:` names as well) and its events are re-hashed from the token
ids they carry (`kv_events/foreign.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm._core import Router
from pagedllm.entrypoints.rendering import Renderer
from pagedllm.kv_events.foreign import ForeignHashes
from pagedllm.kv_events.subscriber import KVEventSubscriber

logger = logging.getLogger(__name__)

# a replica whose /load fails outright (refused, an error status, an unhealthy engine) this many
# times in a row leaves rotation (at the default interval of 0.5 s: within about a second; a
# refused connection on a request takes it out at once)
MAX_FAILED_POLLS = 2
# a replica whose /load has not answered for this long leaves rotation (a hung process). A poll
# that merely times out is not a failure: a busy replica (a long prefill holding its GIL on a
# starved host) answers late but answers, and stays in rotation meanwhile
UNRESPONSIVE_AFTER = 5.0


@dataclass
class Replica:
    index: int
    url: str
    alive: bool = True  # until a poll or a request says otherwise
    failed_polls: int = 0
    last_answer: float = field(default_factory=time.monotonic)  # its last good /load
    instance_id: str | None = None
    lora_ids: dict[str, int] = field(default_factory=dict)
    subscriber: KVEventSubscriber | None = None
    events_key: tuple | None = None  # (endpoint, replay endpoint, topic) subscribed to
    # an external replica's KV-event endpoint and replay endpoint (None: a pagedllm replica)
    external_events: str | None = None
    external_replay: str | None = None
    # from the responses' usage: what the replica's prefix cache actually served
    prompt_tokens: int = 0
    cached_tokens: int = 0
    restarts: int = 0  # new instances seen (a supervisor, or `serve -dp`, restarted it)
    # its /load's renderer description, as JSON (None: it renders nothing for the router)
    renderer_key: str | None = None
    max_body_bytes: int | None = None  # the largest request body it takes (None: not said)
    in_flight: set[InFlight] = field(default_factory=set)  # requests waiting on it now


class ReplicaDown(Exception):
    """The replica a request waits on stopped answering and left rotation."""


# the index of a replica holds at most this many times its cache's blocks (`_update`)
INDEX_SLACK = 2


class InFlight:
    """A request under way on a replica (and its routing ticket, if routed). `end` (the replica
    stopped answering) cancels the wait on it in progress and fails every later one with
    ReplicaDown."""

    def __init__(self, replica: Replica, ticket: int | None) -> None:
        self.replica = replica
        self.ticket = ticket
        self.ended = False
        self._scope: anyio.CancelScope | None = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around one wait on the replica (never around a `yield` to the client: the cancel
        would then land outside it)."""
        if self.ended:
            raise ReplicaDown
        with anyio.CancelScope() as self._scope:
            yield
        self._scope = None
        if self.ended:
            raise ReplicaDown

    def end(self) -> None:
        self.ended = True
        if self._scope is not None:
            self._scope.cancel()


# an external replica's /metrics gauges (either engine's prefix) -> /load's keys
_LOAD_GAUGES = {
    "num_requests_waiting": "num_waiting",
    "num_requests_running": "num_running",
    "kv_cache_usage_perc": "kv_usage",
}


# the families `external_load` reads: a /metrics page is tens of kB (histograms), parsed twice
# a second per replica, so only their lines are handed to the parser
_WANTED = (
    *(f"{engine}:{name}" for engine in ("vllm", "pagedllm") for name in _LOAD_GAUGES),
    "process_start_time_seconds",
    "vllm:cache_config_info",
)


def _wanted_lines(metrics_text: str) -> str:
    keep = []
    for line in metrics_text.splitlines():
        if line.startswith("#"):  # "# HELP name ..." / "# TYPE name kind"
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line
        if name.startswith(_WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def external_load(metrics_text: str) -> dict:
    """An external replica's Prometheus /metrics as /load's fields: the queue gauges (summed over
    their label sets), `instance_id` from `process_start_time_seconds` (a restarted process has
    a new one; None when not exported) and `block_size` from `vllm:cache_config_info`'s label
    (None when not exported). ValueError when the queue gauges are missing (not an engine)."""
    load: dict = {"instance_id": None, "block_size": None}
    for family in text_string_to_metric_families(_wanted_lines(metrics_text)):
        engine, _, name = family.name.rpartition(":")
        for sample in family.samples:
            if engine in ("vllm", "pagedllm") and name in _LOAD_GAUGES:
                key = _LOAD_GAUGES[name]
                load[key] = load.get(key, 0.0) + sample.value
            elif family.name == "process_start_time_seconds":
                load["instance_id"] = repr(sample.value)
            elif family.name == "vllm:cache_config_info" and "block_size" in sample.labels:
                load["block_size"] = int(sample.labels["block_size"])
    missing = [key for key in _LOAD_GAUGES.values() if key not in load]
    if missing:
        raise ValueError(f"its /metrics has no {', '.join(sorted(missing))} gauge")
    load["num_waiting"], load["num_running"] = int(load["num_waiting"]), int(load["num_running"])
    return load


def connect_endpoint(endpoint: str, replica_url: str) -> str:
    """A replica's bind address (`tcp://*:5557`) as the router connects to it (its host)."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    for wildcard in ("*", "0.0.0.0", "[::]"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:{endpoint[len(prefix) :]}"
    return endpoint


def _count(load: dict, key: str) -> int:
    value = load.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"its /load {key} is {value!r}, not a count")
    return value


def parse_load(load) -> dict:
    """A /load answer (or `external_load`'s) checked field by field: ValueError naming the first
    of the wrong shape (a buggy or foreign replica must not reach the router core with it)."""
    if not isinstance(load, dict):
        raise ValueError(f"its /load is a {type(load).__name__}, not a JSON object")
    _count(load, "num_waiting")
    _count(load, "num_running")
    usage = load.get("kv_usage")
    if type(usage) not in (int, float) or not math.isfinite(usage):
        raise ValueError(f"its /load kv_usage is {usage!r}, not a number")
    if not isinstance(load.get("instance_id"), (str, type(None))):
        raise ValueError(f"its /load instance_id is {load['instance_id']!r}, not a string")
    if not isinstance(load.get("healthy", True), bool):
        raise ValueError(f"its /load healthy is {load['healthy']!r}, not a boolean")
    for key in ("block_size", "num_gpu_blocks", "max_request_body_bytes"):
        if load.get(key) is not None:
            _count(load, key)
    loras = load.get("lora_ids") or {}
    if not isinstance(loras, dict) or not all(
        isinstance(k, str) and type(v) is int for k, v in loras.items()
    ):
        raise ValueError(f"its /load lora_ids is {loras!r}, not names to ids")
    renderer = load.get("renderer")
    if renderer is not None and not (
        isinstance(renderer, dict) and isinstance(renderer.get("tokenizer"), str)
    ):
        raise ValueError(f"its /load renderer is {renderer!r}, not a tokenizer's description")
    events = load.get("kv_events")
    if events is not None and not (
        isinstance(events, dict)
        and isinstance(events.get("endpoint"), str)
        and isinstance(events.get("replay_endpoint"), (str, type(None)))
        and isinstance(events.get("topic", ""), str)
    ):
        raise ValueError(f"its /load kv_events is {events!r}, not endpoints")
    return load


class ReplicaSet:
    """The replicas, their Rust router core and its lock (the subscribers' threads and the
    request handlers share it)."""

    def __init__(
        self,
        urls: list[str],
        *,
        block_size: int,
        policy: str,
        external: list[tuple[str, str, str | None]] = (),
        health_interval: float = 0.5,
        unresponsive_after: float = UNRESPONSIVE_AFTER,
        api_key: str | None = None,
        **router_knobs,
    ) -> None:
        """`urls`: `pagedllm serve` replicas; `external`: others' (URL, KV-event endpoint, replay
        endpoint or None); `api_key`: sent on the polls (replicas behind the same key)."""
        if not urls and not external:
            raise ValueError("give at least one --replica URL (or --external-replica)")
        if not unresponsive_after > 0:
            raise ValueError(f"unresponsive_after must be > 0 seconds, got {unresponsive_after}")
        self.replicas = [Replica(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.replicas += [
            Replica(len(urls) + i, url.rstrip("/"), external_events=events, external_replay=replay)
            for i, (url, events, replay) in enumerate(external)
        ]
        self.router = Router(len(self.replicas), block_size, policy, **router_knobs)
        self.block_size = block_size
        self.lock = threading.Lock()
        self.health_interval = health_interval
        self.unresponsive_after = unresponsive_after
        self.poll_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # each renderer the replicas describe (by its JSON), loaded here; None: it cannot be
        self.renderers: dict[str, Renderer | None] = {}
        self._tasks: list[asyncio.Task] = []

    def route(
        self, token_ids: list[int], lora_id: int, session: str | None, excluded: int
    ) -> tuple[Replica, int]:
        """(replica, the request's ticket: give it to `finish` when the request ends);
        PagedLLMError when none is left."""
        with self.lock:
            r, _, _, _, ticket = self.router.route(
                token_ids,
                lora_id=lora_id,
                session=session,
                excluded=excluded,
                now=time.monotonic(),
            )
        return self.replicas[r], ticket

    def finish(self, ticket: int) -> None:
        with self.lock:
            self.router.finish(ticket)

    def mark_down(self, replica: Replica, reason: str, *, end_in_flight: bool = False) -> None:
        """Out of rotation now; the poll brings it back. `end_in_flight` (it stopped answering):
        its requests under way end as well."""
        if replica.alive:
            logger.warning(
                "replica %d (%s) out of rotation: %s", replica.index, replica.url, reason
            )
        replica.alive = False
        with self.lock:
            self.router.set_alive(replica.index, False)
        if end_in_flight and replica.in_flight:
            logger.warning(
                "replica %d: ending its %d requests under way",
                replica.index,
                len(replica.in_flight),
            )
            for request in replica.in_flight:
                request.end()

    def track(self, replica: Replica, ticket: int | None) -> InFlight:
        """A request under way on `replica` from now until `release` (see `InFlight`)."""
        request = InFlight(replica, ticket)
        replica.in_flight.add(request)
        return request

    def release(self, request: InFlight) -> None:
        """The request ended: no longer tracked, its ticket finished. Releasing twice is a
        no-op (a stream's generator and its response's settling may both get here)."""
        request.replica.in_flight.discard(request)
        ticket, request.ticket = request.ticket, None
        if ticket is not None:
            self.finish(ticket)

    @contextlib.contextmanager
    def watch(self, replica: Replica) -> Iterator[InFlight]:
        """An unrouted call to `replica` (no ticket) tracked for the `with` block."""
        request = self.track(replica, None)
        try:
            yield request
        finally:
            self.release(request)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def renderer(self) -> tuple[Renderer, str] | None:
        """(the renderer of the first live replica whose renderer loaded here, its key); None
        when none did (external replicas, or model files the router cannot see)."""
        for replica in self.live():
            renderer = self.renderers.get(replica.renderer_key)
            if renderer is not None:
                return renderer, replica.renderer_key
        return None

    def stats(self) -> list[dict]:
        with self.lock:
            return self.router.stats()

    # ---- the health and load poll ---------------------------------------------------------

    def start(self, client: httpx.AsyncClient) -> None:
        # one loop per replica: a slow one's poll does not hold back the others' load reports
        self._tasks = [
            asyncio.ensure_future(self._poll_forever(client, r)) for r in self.replicas
        ] + [asyncio.ensure_future(self._expire_forever())]

    async def stop(self) -> None:
        """Stops the polls and the subscribers, whatever state they are in (a shutdown that
        raised here would leave the router up after SIGTERM)."""
        for task in self._tasks:
            task.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            self._tasks = []
            for replica in self.replicas:
                if replica.subscriber is not None:
                    replica.subscriber.close()
                    replica.subscriber = None

    async def _poll_forever(self, client: httpx.AsyncClient, replica: Replica) -> None:
        while True:
            try:
                await self._poll_one(client, replica)
            except Exception as exc:  # noqa: BLE001 - nothing a replica answers ends its poll
                logger.exception("replica %d: polling it failed", replica.index)
                self._failed_poll(replica, exc)
            await asyncio.sleep(self.health_interval)

    async def _expire_forever(self) -> None:
        while True:
            with self.lock:
                self.router.expire_pending(time.monotonic())
            await asyncio.sleep(self.health_interval)

    async def poll(self, client: httpx.AsyncClient) -> None:
        """Polls every replica once, together."""
        await asyncio.gather(*(self._poll_one(client, r) for r in self.replicas))

    async def _poll_one(self, client: httpx.AsyncClient, replica: Replica) -> None:
        try:
            # bounded as a whole (httpx's timeouts are per phase): a hung replica's poll ends
            # when its silence reaches the bound, so it leaves rotation then
            bound = self.unresponsive_after
            if replica.alive:  # what is left of its bound
                bound -= time.monotonic() - replica.last_answer
            path = "/metrics" if replica.external_events else "/load"
            response = await asyncio.wait_for(
                client.get(f"{replica.url}{path}", headers=self.poll_headers),
                max(bound, self.health_interval),
            )
            response.raise_for_status()
            load = parse_load(
                external_load(response.text) if replica.external_events else response.json()
            )
            if not load.get("healthy", True):
                raise ValueError("its engine reports itself unhealthy")
        except (TimeoutError, httpx.TimeoutException):
            silent_for = time.monotonic() - replica.last_answer
            if silent_for >= self.unresponsive_after:
                reason = f"/load has not answered for {silent_for:.1f} s"
                self.mark_down(replica, reason, end_in_flight=True)
            return
        except (httpx.HTTPError, ValueError) as exc:  # a JSON error is a ValueError
            self._failed_poll(replica, exc)
            return
        replica.failed_polls = 0
        replica.last_answer = time.monotonic()
        await self._learn_renderer(replica, load.get("renderer"))
        self._update(replica, load)

    async def _learn_renderer(self, replica: Replica, description: dict | None) -> None:
        """Loads a renderer the first time a replica describes it (off the event loop: a
        tokenizer takes up to seconds to load); one that fails is logged once, and requests
        are then tokenized by a replica's /tokenize."""
        key = None if description is None else json.dumps(description, sort_keys=True)
        if key is not None and key not in self.renderers:
            self.renderers[key] = None  # a concurrent poll does not load it twice
            try:
                self.renderers[key] = await asyncio.to_thread(Renderer.load, description)
            except Exception as exc:  # noqa: BLE001 - tokenizer libraries raise their own
                logger.warning(
                    "replica %d: its tokenizer cannot be loaded here (%s); the router asks a "
                    "replica's /tokenize instead",
                    replica.index,
                    exc,
                )
        replica.renderer_key = key

    def _failed_poll(self, replica: Replica, exc: Exception) -> None:
        replica.failed_polls += 1
        if replica.failed_polls >= MAX_FAILED_POLLS:
            self.mark_down(replica, f"/load failed {replica.failed_polls} times ({exc!r})")

    def _update(self, replica: Replica, load: dict) -> None:
        restarted = replica.instance_id is not None and load["instance_id"] != replica.instance_id
        if restarted:
            replica.restarts += 1
            logger.warning("replica %d (%s) is a new instance", replica.index, replica.url)
        replica.instance_id = load["instance_id"]
        replica.lora_ids = dict(load.get("lora_ids") or {})
        replica.max_body_bytes = load.get("max_request_body_bytes")
        with self.lock:
            self.router.set_load(
                replica.index, load["num_waiting"], load["num_running"], load["kv_usage"]
            )
            if restarted:  # a new process: its cache starts empty, its batches from 0
                self.router.reset_replica(replica.index)
            if load.get("num_gpu_blocks"):
                # an honest replica never holds more blocks than its cache; twice that leaves
                # room for a batch that stores before it removes
                self.router.set_index_capacity(replica.index, INDEX_SLACK * load["num_gpu_blocks"])
        self._subscribe(replica, load)
        if restarted and replica.subscriber is not None:
            replica.subscriber.resync(restarted=True)
        if not replica.alive:
            if replica.subscriber is not None:
                replica.subscriber.resync()  # catch up on what happened while it was out
            logger.warning("replica %d (%s) back in rotation", replica.index, replica.url)
            replica.alive = True
            with self.lock:
                self.router.set_alive(replica.index, True)

    def _subscribe(self, replica: Replica, load: dict) -> None:
        events, block_size = load.get("kv_events"), load.get("block_size")
        if replica.external_events:
            events = {
                "endpoint": replica.external_events,
                "replay_endpoint": replica.external_replay,
            }
            block_size = block_size or self.block_size  # not on its /metrics: its events say
        if events is None or block_size != self.block_size:
            if events is not None and replica.events_key != "mismatch":
                logger.warning(
                    "replica %d hashes %s-token blocks, the router %d: its events are ignored",
                    replica.index,
                    block_size,
                    self.block_size,
                )
                replica.events_key = "mismatch"
            return
        replay = events.get("replay_endpoint")
        key = (
            connect_endpoint(events["endpoint"], replica.url),
            connect_endpoint(replay, replica.url) if replay else None,
            events.get("topic", ""),
        )
        if key == replica.events_key:
            if replica.subscriber is not None:
                replica.subscriber.revive()  # a thread that ended anyway: logged and counted
            return
        if replica.subscriber is not None:
            replica.subscriber.close()
        replica.events_key = key
        foreign = ForeignHashes(self.block_size) if replica.external_events else None
        replica.subscriber = KVEventSubscriber(
            self.router, self.lock, replica.index, *key, foreign=foreign
        ).start()
