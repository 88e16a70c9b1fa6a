"""A routed stream releases its replica's request however it ends, even when the client leaves
before the first chunk is sent (the stream's generator then never runs)."""

from __future__ import annotations

import asyncio
import contextlib

from pagedllm.router.app import _SettledStream
from pagedllm.router.replicas import ReplicaSet


def _replicas() -> ReplicaSet:
    return ReplicaSet(["http://127.0.0.1:9"], block_size=16, policy="round_robin")


def test_releasing_a_request_twice_finishes_its_ticket_once():
    replicas = _replicas()
    replica, ticket = replicas.route([1, 2, 3], 0, None, 0)
    request = replicas.track(replica, ticket)
    replicas.release(request)
    replicas.release(request)
    assert request.ticket is None and not replica.in_flight


def _run(send) -> tuple[list[str], bool]:
    """Serves a _SettledStream over `send`; (what the generator did, whether settle ran)."""
    seen: list[str] = []
    settled = asyncio.Event()

    async def body():
        seen.append("started")
        yield b"data: x\n\n"

    async def settle() -> None:
        settled.set()

    async def receive():
        await asyncio.sleep(3600)

    async def main() -> None:
        stream = _SettledStream(body(), settle, headers={})
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        # the disconnect surfaces as starlette's ClientDisconnect: what matters is the settle
        with contextlib.suppress(Exception):
            await stream(scope, receive, send)

    asyncio.run(main())
    return seen, settled.is_set()


def test_a_client_gone_before_the_first_chunk_still_settles_the_stream():
    async def send(message) -> None:
        raise OSError("client disconnected")

    seen, settled = _run(send)
    assert seen == [] and settled


def test_a_stream_sent_whole_settles_once_it_is_over():
    sent = []

    async def send(message) -> None:
        sent.append(message)

    seen, settled = _run(send)
    assert seen == ["started"] and settled and sent[-1]["more_body"] is False
