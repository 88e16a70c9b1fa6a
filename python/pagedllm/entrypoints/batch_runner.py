"""Batch files in OpenAI's line format, answered by the server's own routes.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with `url` one of
BATCH_URLS; each output line is `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}`, or an error line (`error: {"code", "message"}`; `response` null when
the line never reached a route, else the route's 4xx answer) — one bad line never loses the batch.
Every request goes through the app's routes in-process (httpx's ASGI transport), so a body is
validated and answered exactly as `pagedllm serve` would. `pagedllm run-batch` (a file) and
`/v1/batches` (batches.py) both run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# requests in flight at once: enough for the scheduler to fill its batches, few enough that a
# huge file is not all tokenized and queued before the first answer
MAX_IN_FLIGHT = 256


@dataclass
class BatchCounts:
    """What a batch did (the CLI's summary line; a batch object's `request_counts`)."""

    completed: int = 0
    failed: int = 0
    total_tokens: int = 0

    def add(self, result: dict) -> None:
        if result["error"] is None:
            self.completed += 1
            usage = result["response"]["body"].get("usage") or {}
            self.total_tokens += usage.get("total_tokens") or 0
        else:
            self.failed += 1


@contextlib.asynccontextmanager
async def in_process_client(app) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app`'s routes with its lifespan run (the engine loop started, then stopped)."""
    async with app.router.lifespan_context(app), app_client(app) as client:
        yield client


def app_client(app, api_key: str | None = None) -> httpx.AsyncClient:
    """A client of an already running `app`'s routes, in-process."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://pagedllm",
        headers=headers,
        timeout=None,
    )


def _error_line(custom_id, code: str, message: str, response: dict | None = None) -> dict:
    return {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message},
    }


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def _parse(line: str, number: int, urls: Sequence[str]) -> dict:
    """The request of one input line, or ValueError(code, message) naming what is wrong."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError("invalid_json", f"line {number}: not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise ValueError("invalid_request", f"line {number}: not a JSON object")
    if not isinstance(request.get("custom_id"), str):
        raise ValueError("invalid_request", f"line {number}: 'custom_id' must be a string")
    if request.get("method", "POST") != "POST":
        raise ValueError(
            "invalid_method", f"line {number}: 'method' must be POST, got {request['method']!r}"
        )
    if request.get("url") not in urls:
        raise ValueError(
            "invalid_url",
            f"line {number}: 'url' must be {' or '.join(urls)}; got {request.get('url')!r}",
        )
    body = request.get("body")
    if not isinstance(body, dict):
        raise ValueError("invalid_request", f"line {number}: 'body' must be a JSON object")
    if body.get("stream"):
        raise ValueError("invalid_request", f"line {number}: 'stream' is not served in a batch")
    return request


async def answer_line(
    client: httpx.AsyncClient,
    line: str,
    number: int,
    body_defaults: dict | None = None,
    urls: Sequence[str] = BATCH_URLS,
) -> dict:
    """The output line of input line `number` (1-based): the route's answer, or an error line.
    `body_defaults`: fields set in a body that does not give them (e.g. a batch's priority);
    `urls`: the routes lines may name (a /v1/batches batch: its endpoint)."""
    try:
        request = _parse(line, number, urls)
    except ValueError as exc:
        code, message = exc.args
        custom_id = _custom_id(line)
        return _error_line(custom_id, code, message)
    body = {**(body_defaults or {}), **request["body"]}
    try:
        answer = await client.post(request["url"], json=body)
        answer_body = answer.json()
    except Exception as exc:  # noqa: BLE001 - one failing request never loses the batch
        message = f"line {number}: {type(exc).__name__}: {exc}"
        return _error_line(request["custom_id"], "internal_error", message)
    response = {
        "status_code": answer.status_code,
        "request_id": answer.headers.get("x-request-id") or _line_id(),
        "body": answer_body,
    }
    if answer.status_code == 200:
        response["request_id"] = response["body"].get("id") or response["request_id"]
        return {"id": _line_id(), "custom_id": request["custom_id"], "response": response,
                "error": None}  # fmt: skip
    error = response["body"].get("error") or {}
    code = error.get("type") or str(answer.status_code)
    message = f"line {number}: {error.get('message') or answer.text}"
    return _error_line(request["custom_id"], code, message, response)


def _custom_id(line: str):
    """The custom_id of a line that is otherwise bad, where one can be read."""
    with contextlib.suppress(ValueError):
        request = json.loads(line)
        if isinstance(request, dict) and isinstance(request.get("custom_id"), str):
            return request["custom_id"]
    return None


async def run_lines(
    client: httpx.AsyncClient,
    lines: Sequence[str],
    on_result: Callable[[dict], None] = lambda result: None,
    body_defaults: dict | None = None,
    urls: Sequence[str] = BATCH_URLS,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> AsyncIterator[dict]:
    """The output lines of `lines` (blank ones skipped), in input order, as each is ready;
    `on_result` sees each as it finishes (in any order: a progress bar); at most
    `max_in_flight` requests at the engine at once."""
    limit = asyncio.Semaphore(max_in_flight)

    async def answer(line: str, number: int) -> dict:
        async with limit:
            result = await answer_line(client, line, number, body_defaults, urls)
        on_result(result)
        return result

    tasks = [
        asyncio.ensure_future(answer(line, number))
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    try:
        for task in tasks:
            yield await task
    finally:
        for task in tasks:
            task.cancel()
