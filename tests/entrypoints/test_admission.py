"""Admission control counts every request the same way: a constrained request (whose grammar
compiles before it is queued) and a multi-prompt request count against `max_queued_requests`
from the moment they are admitted, like a plain one."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from server_util import MODEL, live_server

PLAIN = {"model": MODEL, "prompt": "queued", "max_tokens": 2, "temperature": 0}
CHOICE = {**PLAIN, "structured_outputs": {"choice": ["yes", "no"]}}


class HeldStep:
    """`LLMEngine.step` held from its second call until released: the first request is then
    running (it has its first token), and everything sent meanwhile stays queued."""

    def __init__(self, engine) -> None:
        self.engine, self.real_step = engine, engine.step
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        engine.step = self

    def __call__(self):
        self.calls += 1
        if self.calls > 1:
            self.entered.set()
            self.release.wait(timeout=30)
            self.engine.step = self.real_step
        return self.real_step()


async def _post_all(url: str, bodies: list[dict], held: HeldStep) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.ensure_future(client.post(url, json=body)) for body in bodies]
        # the refused answer at once; the admitted wait for the held step
        deadline = time.monotonic() + 20
        while sum(t.done() for t in tasks) < len(bodies) - 2:
            assert time.monotonic() < deadline, "requests neither refused nor queued"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # a request wrongly admitted would be queued by now
        held.release.set()
        return [(await t).status_code for t in tasks]


def _statuses_while_held(bodies: list[dict], limit: int = 2) -> list[int]:
    with live_server(max_queued_requests=limit) as live:
        held = HeldStep(live.engine.engine)
        url = f"{live.url}/v1/completions"
        with httpx.Client(timeout=60) as client:
            running = {**PLAIN, "max_tokens": 8, "ignore_eos": True}
            first = threading.Thread(target=client.post, args=(url,), kwargs={"json": running})
            first.start()
            assert held.entered.wait(timeout=20)
            statuses = asyncio.run(_post_all(url, bodies, held))
            first.join(timeout=30)
        return sorted(statuses)


def test_constrained_requests_count_against_max_queued_requests():
    assert _statuses_while_held([CHOICE] * 8) == [200] * 2 + [429] * 6


def test_constrained_and_plain_requests_share_one_admission_count():
    assert _statuses_while_held([CHOICE, PLAIN] * 4) == [200] * 2 + [429] * 6


def test_a_multi_prompt_request_counts_each_prompt_until_it_is_queued():
    two = {**CHOICE, "prompt": ["one", "two"]}
    assert _statuses_while_held([two] * 4, limit=2) == [200] + [429] * 3
