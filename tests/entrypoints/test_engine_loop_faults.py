"""The server's engine loop under injected step faults: a transient burst is survived (health
fails only while steps keep failing), a broken engine ends its requests with 503 and makes
`pagedllm serve` exit with status 1 instead of living on refusing everything; a poisoned request
(its forward always fails) ends alone while the others finish as they would without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from pagedllm.entrypoints.async_engine import BACKOFF_CAP_S, UNHEALTHY_AFTER_FAILURES, backoff_s

from server_util import ENGINE, MODEL, free_port, live_server, wait_healthy

BODY = {"model": MODEL, "prompt": "go", "max_tokens": 4, "ignore_eos": True, "temperature": 0}


class FlakySteps:
    """`LLMEngine.step` that raises (a transient device error) while `failing` is set."""

    def __init__(self, engine) -> None:
        self.real_step = engine.step
        self.failing = threading.Event()
        self.failures = 0
        engine.step = self

    def __call__(self):
        if self.failing.is_set():
            self.failures += 1
            raise RuntimeError("injected transient device error")
        return self.real_step()

    def wait_failures(self, count: int) -> None:
        deadline = time.monotonic() + 20
        while self.failures < count:
            assert time.monotonic() < deadline, f"only {self.failures} failed steps"
            time.sleep(0.01)


def test_back_off_doubles_per_failure_up_to_a_cap():
    delays = [backoff_s(k) for k in range(1, 12)]
    assert delays[1] == 2 * delays[0]
    assert delays == sorted(delays)
    assert delays[-1] == BACKOFF_CAP_S


def test_health_fails_and_new_requests_get_503_while_steps_keep_failing():
    with live_server() as live:
        steps = FlakySteps(live.engine.engine)
        steps.failing.set()
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{live.url}/v1/completions", json=BODY, timeout=30)
            steps.wait_failures(UNHEALTHY_AFTER_FAILURES + 2)
            health = httpx.get(f"{live.url}/health")
            assert health.status_code == 503
            assert "failing" in health.json()["error"]["message"]
            refused = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "service_unavailable"
            steps.failing.clear()
            assert in_flight.result().status_code == 200


def test_a_burst_of_failed_steps_is_survived_and_health_recovers():
    with live_server() as live:
        steps = FlakySteps(live.engine.engine)
        steps.failing.set()
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, f"{live.url}/v1/completions", json=BODY, timeout=30)
            steps.wait_failures(8)  # well past the old limit of 5, which killed the loop
            steps.failing.clear()
            response = in_flight.result()
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(f"{live.url}/health").status_code == 200
        fresh = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
        assert fresh.status_code == 200
        assert len(fresh.json()["choices"][0]["text"]) > 0


def test_health_is_200_again_once_the_failing_requests_were_given_up():
    # a forward that fails: the engine gives its request up after a few steps (finish reason
    # "abort"); with nothing left to fail on, the server takes requests again
    with live_server() as live:
        runner = live.engine.engine.runner
        real_forward = runner.forward

        def broken_forward(*args, **kwargs):
            raise RuntimeError("injected device error")

        runner.forward = broken_forward
        given_up = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
        assert given_up.status_code == 200
        assert given_up.json()["choices"][0]["finish_reason"] == "abort"
        runner.forward = real_forward
        assert httpx.get(f"{live.url}/health").status_code == 200
        fresh = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
        assert fresh.status_code == 200
        assert fresh.json()["choices"][0]["finish_reason"] == "length"


def test_an_engine_that_never_recovers_ends_its_requests_with_503_and_stops():
    with live_server(max_failed_steps=5) as live:
        steps = FlakySteps(live.engine.engine)
        steps.failing.set()
        response = httpx.post(f"{live.url}/v1/completions", json=BODY, timeout=30)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        assert steps.failures == 5
        assert live.engine.dead
        assert httpx.get(f"{live.url}/health").status_code == 503


SERVE_A_BROKEN_ENGINE = """
import sys
from pagedllm.entrypoints.api_server import ServerConfig, build_server_app, run_server

app = build_server_app({engine!r}, ServerConfig(served_model_name={model!r}, max_failed_steps=3))

def broken_step():
    raise RuntimeError("injected permanent device error")

app.state.server.engine.engine.step = broken_step
sys.exit(run_server(app, "127.0.0.1", {port}, log_level="critical"))
"""


def test_serve_exits_with_status_1_once_the_engine_is_broken():
    port = free_port()
    script = SERVE_A_BROKEN_ENGINE.format(engine=ENGINE, model=MODEL, port=port)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        response = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert response.status_code == 503
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- a poisoned request among others ----------------------------------------------------------

POISON_LEN = 80  # no innocent prompt plus its output gets this long
POISONED = {"model": MODEL, "prompt": "z" * 90, "max_tokens": 4, "temperature": 0}
INNOCENTS = [
    {"model": MODEL, "prompt": p, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    for p in ("hello", "the sky", "one two three")
]


def poison_long_forwards(engine) -> None:
    """From now on any forward over a sequence of `POISON_LEN` tokens or more raises, every
    time (an out-of-memory on one long prompt)."""
    runner = engine.runner
    real_forward = runner.forward

    def forward(inputs, *args, **kwargs):
        if inputs[2].max_seq_len >= POISON_LEN:
            raise RuntimeError("CUDA out of memory (injected)")
        return real_forward(inputs, *args, **kwargs)

    runner.forward = forward


def completions(url: str, bodies: list[dict]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [
            pool.submit(httpx.post, f"{url}/v1/completions", json=b, timeout=60) for b in bodies
        ]
        return [f.result() for f in futures]


def innocents_then_poisoned(live) -> tuple[list[httpx.Response], httpx.Response]:
    """The innocent requests, and once each has produced output, the poisoned one: requests
    that arrive while the poisoned one keeps failing steps may be refused (503, the engine is
    failing); those already running must not suffer."""
    started: set[str] = set()
    live.engine.on_output.append(lambda output: started.add(output.request_id))
    try:
        with ThreadPoolExecutor(len(INNOCENTS)) as pool:
            futures = [
                pool.submit(httpx.post, f"{live.url}/v1/completions", json=b, timeout=60)
                for b in INNOCENTS
            ]
            deadline = time.monotonic() + 60
            while len(started) < len(INNOCENTS) and time.monotonic() < deadline:
                time.sleep(0.005)
            poisoned = httpx.post(f"{live.url}/v1/completions", json=POISONED, timeout=60)
            return [f.result() for f in futures], poisoned
    finally:
        live.engine.on_output.pop()


def texts(responses: list[httpx.Response]) -> list[str]:
    assert [r.status_code for r in responses] == [200] * len(responses)
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses)
    return [r.json()["choices"][0]["text"] for r in responses]


def assert_given_up_alone(response: httpx.Response) -> None:
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert "injected" in choice["stop_reason"]


def test_a_poisoned_request_ends_alone_and_the_others_finish_as_without_it():
    with live_server() as live:
        expected = texts(completions(live.url, INNOCENTS))
        poison_long_forwards(live.engine.engine)
        innocents, poisoned = innocents_then_poisoned(live)
        assert_given_up_alone(poisoned)
        assert texts(innocents) == expected
        assert httpx.get(f"{live.url}/health").status_code == 200
        live.wait_idle()


def test_three_poisoned_requests_in_a_row_leave_the_server_serving():
    with live_server() as live:
        expected = texts(completions(live.url, INNOCENTS))
        poison_long_forwards(live.engine.engine)
        for _ in range(3):
            innocents, poisoned = innocents_then_poisoned(live)
            assert_given_up_alone(poisoned)
            assert texts(innocents) == expected
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert not live.engine.dead
        live.wait_idle()
