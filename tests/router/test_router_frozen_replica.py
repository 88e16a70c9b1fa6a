"""A replica that stops answering (SIGSTOP: no reply, no reset) leaves rotation once its /load
has been silent for `unresponsive_after`, and then its requests under way end too: a stream
already answering with an error event and [DONE], a request with nothing sent to the client yet
by going to another replica."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from fake_replica import GOOD_LOAD, FakeReplica
from router_util import routed, wait_for

UNRESPONSIVE_AFTER = 1.0
# the poll that notices runs every 0.1 s (router_util.routed); the rest is the slow test host
BOUND_S = UNRESPONSIVE_AFTER + 1.5


@pytest.fixture
def two_fakes(tmp_path, request):
    a = FakeReplica(tmp_path, "a", *getattr(request, "param", ()))
    b = FakeReplica(tmp_path, "b", load={**GOOD_LOAD, "num_waiting": 50})
    yield a, b
    a.close()
    b.close()


def test_streams_on_a_frozen_replica_end_with_an_error_event_within_the_bound(two_fakes):
    a, b = two_fakes
    body = {"model": "m", "prompt": [1, 2, 3], "stream": True, "max_tokens": 30}
    with (
        routed([a.url, b.url], "round_robin", unresponsive_after=UNRESPONSIVE_AFTER) as live,
        contextlib.ExitStack() as streams,
    ):
        router, state = live[0].url, live[1]
        client = streams.enter_context(httpx.Client(timeout=30))
        on = {"0": [], "1": []}
        for _ in range(4):
            r = streams.enter_context(client.stream("POST", f"{router}/v1/completions", json=body))
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # under way
            on[r.headers["x-pagedllm-replica"]].append(lines)
        assert len(on["0"]) == len(on["1"]) == 2
        a.freeze()
        frozen_at = time.monotonic()
        for lines in on["0"]:
            rest = [line for line in lines if line.startswith("data: ")]
            error = json.loads(rest[-2][6:])["error"]
            assert error["code"] == 502 and "stopped answering" in error["message"]
            assert rest[-1] == "data: [DONE]"
        assert time.monotonic() - frozen_at < BOUND_S
        assert not state.replicas[0].alive
        for lines in on["1"]:  # the other replica's streams are untouched
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)


@pytest.mark.parametrize("two_fakes", [("--hang",)], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_with_no_byte_sent_yet_goes_to_another_replica(two_fakes, stream):
    a, b = two_fakes  # a never answers a completion; b reports a long queue, so a is chosen
    body = {"model": "m", "prompt": [1, 2, 3], "stream": stream, "max_tokens": 2}
    with routed([a.url, b.url], "least_loaded", unresponsive_after=UNRESPONSIVE_AFTER) as (
        router,
        state,
    ):
        answers = []
        sent = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
            )
        )
        sent.start()
        wait_for(lambda: state.stats()[0]["in_flight"] == 1, what="the request on replica 0")
        a.freeze()
        frozen_at = time.monotonic()
        sent.join(timeout=10)
        assert time.monotonic() - frozen_at < BOUND_S
        (answer,) = answers
        assert answer.status_code == 200 and answer.headers["x-pagedllm-replica"] == "1"
        assert '"error"' not in answer.text
