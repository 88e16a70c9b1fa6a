"""/v1/files and /v1/batches through the official `openai` client: a file uploaded, a batch run
on the server's engine, its results downloaded equal to the server's own answers."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from server_util import MODEL, live_server

COMPLETION = {"model": MODEL, "prompt": "The sky is", "max_tokens": 6, "temperature": 0}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _upload(client, lines: list[str]):
    data = io.BytesIO(("\n".join(lines) + "\n").encode())
    return client.files.create(file=("requests.jsonl", data), purpose="batch")


def _wait(client, batch_id: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"the batch is still {batch.status}"
        time.sleep(0.05)


def _rows(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def _comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_batch_runs_to_completion_with_results_equal_to_the_server(client, server):
    bodies = [{**COMPLETION, "prompt": p} for p in ("The sky is", "Once upon", "Hello")]
    upload = _upload(client, [_line(f"r{i}", "/v1/completions", b) for i, b in enumerate(bodies)])
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert batch.status == "in_progress"
    batch = _wait(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed) == (3, 3)
    assert batch.error_file_id is None
    rows = _rows(client, batch.output_file_id)
    assert [r["custom_id"] for r in rows] == ["r0", "r1", "r2"]
    for row, body in zip(rows, bodies, strict=True):
        expected = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
        assert _comparable(row["response"]["body"]) == _comparable(expected)


def test_batch_puts_bad_lines_in_its_error_file(client):
    lines = [
        _line("good", "/v1/completions", COMPLETION),
        "{not json",
        _line("other-url", "/v1/chat/completions", {"model": MODEL, "messages": []}),
        _line("bad-body", "/v1/completions", {**COMPLETION, "max_tokens": -1}),
    ]
    batch = client.batches.create(
        input_file_id=_upload(client, lines).id,
        endpoint="/v1/completions",
        completion_window="24h",
    )
    batch = _wait(client, batch.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == (
        "completed",
        1,
        3,
    )
    assert [r["custom_id"] for r in _rows(client, batch.output_file_id)] == ["good"]
    errors = _rows(client, batch.error_file_id)
    assert [r["error"]["code"] for r in errors] == [
        "invalid_json",
        "invalid_url",
        "invalid_request_error",
    ]


def test_batches_are_listed_newest_first_and_retrieved_by_id(client):
    upload = _upload(client, [_line("x", "/v1/completions", COMPLETION)])
    made = [
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        for _ in range(2)
    ]
    for batch in made:
        _wait(client, batch.id)
    listed = [b.id for b in client.batches.list(limit=100).data]
    assert listed.index(made[1].id) < listed.index(made[0].id)
    assert client.files.retrieve(upload.id).purpose == "batch"


def test_cancelled_batch_ends_cancelled(client, server):
    body = {**COMPLETION, "max_tokens": 100, "ignore_eos": True}
    lines = [_line(f"r{i}", "/v1/completions", body) for i in range(40)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines).id,
        endpoint="/v1/completions",
        completion_window="24h",
    )
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed < 40
    server.wait_idle()  # the cancelled lines' engine requests were aborted


def test_batch_of_an_unknown_file_is_a_404(client):
    with pytest.raises(NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        )


def test_batch_with_an_unknown_endpoint_is_a_400_naming_it(client):
    upload = _upload(client, [_line("x", "/v1/completions", COMPLETION)])
    with pytest.raises(BadRequestError) as info:
        client.batches.create(
            input_file_id=upload.id, endpoint="/v1/moderations", completion_window="24h"
        )
    assert info.value.body["param"] == "endpoint"


def test_file_with_another_purpose_is_a_400(client):
    with pytest.raises(BadRequestError) as info:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert info.value.body["param"] == "purpose"


def test_batch_requests_reach_the_engine_at_low_priority(client, server, monkeypatch):
    from pagedllm.entrypoints.batches import BATCH_PRIORITY

    engine, priorities = server.engine, []
    submit = engine.submit

    def spy(*args, priority=0, **kwargs):
        priorities.append(priority)
        return submit(*args, priority=priority, **kwargs)

    monkeypatch.setattr(engine, "submit", spy)
    upload = _upload(client, [_line("x", "/v1/completions", COMPLETION)])
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert _wait(client, batch.id).status == "completed"
    client.completions.create(**COMPLETION)
    assert priorities == [BATCH_PRIORITY, 0]


def test_batch_keeps_half_the_sequences_free_for_interactive_requests(client, server):
    body = {**COMPLETION, "max_tokens": 30, "ignore_eos": True}
    lines = [_line(f"r{i}", "/v1/completions", body) for i in range(24)]
    batch = client.batches.create(
        input_file_id=_upload(client, lines).id,
        endpoint="/v1/completions",
        completion_window="24h",
    )
    in_engine = []
    while client.batches.retrieve(batch.id).status == "in_progress":
        in_engine.append(
            server.metric("pagedllm:num_requests_running")
            + server.metric("pagedllm:num_requests_waiting")
        )
    assert client.batches.retrieve(batch.id).request_counts.completed == 24
    limit = server.engine.engine.args.max_num_seqs // 2
    assert 1 < max(in_engine) <= limit


def test_batch_runs_on_a_server_with_an_api_key():
    with live_server(api_key="sekret") as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)
        upload = _upload(client, [_line("x", "/v1/completions", COMPLETION)])
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        batch = _wait(client, batch.id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 1)
