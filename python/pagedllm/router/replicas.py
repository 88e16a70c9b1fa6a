"""The replicas as the router knows them: the Rust `Router` (prefix index, load, policies) behind
one lock, a KV-event subscriber per replica, and the health poll that takes a replica out of
rotation when it stops answering and back in (resynced) when it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from pagedllm._core import Router
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
    # from the responses' usage: what the replica's prefix cache actually served
    prompt_tokens: int = 0
    cached_tokens: int = 0


def connect_endpoint(endpoint: str, replica_url: str) -> str:
    """A replica's bind address (`tcp://*:5557`) as the router connects to it (its host)."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    for wildcard in ("*", "0.0.0.0", "[::]"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:{endpoint[len(prefix) :]}"
    return endpoint


class ReplicaSet:
    """The replicas, their Rust router core and its lock (the subscribers' threads and the
    request handlers share it)."""

    def __init__(
        self,
        urls: list[str],
        *,
        block_size: int,
        policy: str,
        health_interval: float = 0.5,
        unresponsive_after: float = UNRESPONSIVE_AFTER,
        **router_knobs,
    ) -> None:
        if not urls:
            raise ValueError("give at least one --replica URL")
        if not unresponsive_after > 0:
            raise ValueError(f"unresponsive_after must be > 0 seconds, got {unresponsive_after}")
        self.replicas = [Replica(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.router = Router(len(urls), block_size, policy, **router_knobs)
        self.block_size = block_size
        self.lock = threading.Lock()
        self.health_interval = health_interval
        self.unresponsive_after = unresponsive_after
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

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Out of rotation now (a request could not reach it); the poll brings it back."""
        if replica.alive:
            logger.warning(
                "replica %d (%s) out of rotation: %s", replica.index, replica.url, reason
            )
        replica.alive = False
        with self.lock:
            self.router.set_alive(replica.index, False)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for replica in self.replicas:
            if replica.subscriber is not None:
                replica.subscriber.close()
                replica.subscriber = None

    async def _poll_forever(self, client: httpx.AsyncClient, replica: Replica) -> None:
        while True:
            await self._poll_one(client, replica)
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
            response = await asyncio.wait_for(
                client.get(f"{replica.url}/load"), max(bound, self.health_interval)
            )
            response.raise_for_status()
            load = response.json()
            if not load.get("healthy", True):
                raise ValueError("its engine reports itself unhealthy")
        except (TimeoutError, httpx.TimeoutException):
            silent_for = time.monotonic() - replica.last_answer
            if silent_for >= self.unresponsive_after:
                self.mark_down(replica, f"/load has not answered for {silent_for:.1f} s")
            return
        except (httpx.HTTPError, ValueError) as exc:
            replica.failed_polls += 1
            if replica.failed_polls >= MAX_FAILED_POLLS:
                self.mark_down(replica, f"/load failed {replica.failed_polls} times ({exc!r})")
            return
        replica.failed_polls = 0
        replica.last_answer = time.monotonic()
        self._update(replica, load)

    def _update(self, replica: Replica, load: dict) -> None:
        restarted = replica.instance_id is not None and load["instance_id"] != replica.instance_id
        replica.instance_id = load["instance_id"]
        replica.lora_ids = dict(load.get("lora_ids") or {})
        with self.lock:
            self.router.set_load(
                replica.index, load["num_waiting"], load["num_running"], load["kv_usage"]
            )
            if restarted:  # a new process: its cache starts empty, its batches from 0
                self.router.reset_replica(replica.index)
        self._subscribe(replica, load)
        if restarted and replica.subscriber is not None:
            replica.subscriber.resync()
        if not replica.alive:
            if replica.subscriber is not None:
                replica.subscriber.resync()  # catch up on what happened while it was out
            logger.warning("replica %d (%s) back in rotation", replica.index, replica.url)
            replica.alive = True
            with self.lock:
                self.router.set_alive(replica.index, True)

    def _subscribe(self, replica: Replica, load: dict) -> None:
        events = load.get("kv_events")
        if events is None or load.get("block_size") != self.block_size:
            if events is not None and replica.events_key != "mismatch":
                logger.warning(
                    "replica %d hashes %s-token blocks, the router %d: its events are ignored",
                    replica.index,
                    load.get("block_size"),
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
            return
        if replica.subscriber is not None:
            replica.subscriber.close()
        replica.events_key = key
        replica.subscriber = KVEventSubscriber(self.router, self.lock, replica.index, *key).start()
