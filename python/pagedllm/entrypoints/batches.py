"""OpenAI's Files and Batches APIs over the server's own engine: `POST /v1/files` (multipart,
purpose "batch"), `GET /v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`;
`POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`.

A batch's lines are answered by the server's routes in-process (batch_runner.py), at most half
of `--max-num-seqs` at once (the other half stays free for interactive requests, whatever the
policy) and at priority BATCH_PRIORITY (after every interactive request under `--policy
priority`), so interactive traffic keeps its latency. Results: `output_file_id` (the
answered lines) and `error_file_id` (the error lines), in input order, as OpenAI splits them.
Files and batches live in memory: they are gone when the server stops.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, StrictStr, ValidationError

from pagedllm.entrypoints.batch_runner import BatchCounts, app_client, run_lines
from pagedllm.entrypoints.errors import APIError, ErrorResponse

BATCH_PRIORITY = 1_000_000  # a lower value is more urgent; interactive requests default to 0
_CLIENT_ERROR = {"4XX": {"model": ErrorResponse, "description": "A client error (400, 404)"}}


class CreateBatchRequest(BaseModel):
    input_file_id: StrictStr
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]  # BATCH_URLS
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class _Store:
    """The files and batches of one server, and the tasks running the batches."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[dict, bytes]] = {}
        self.batches: dict[str, dict] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def add_file(self, name: str, purpose: str, content: bytes) -> dict:
        meta = {
            "id": f"file-{uuid.uuid4().hex}",
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": name,
            "purpose": purpose,
            "status": "processed",
        }
        self.files[meta["id"]] = (meta, content)
        return meta

    def file(self, file_id: str) -> tuple[dict, bytes]:
        if file_id not in self.files:
            raise APIError(404, f"no file '{file_id}'", param="file_id", type_="not_found_error")
        return self.files[file_id]

    def batch(self, batch_id: str) -> dict:
        if batch_id not in self.batches:
            raise APIError(404, f"no batch '{batch_id}'", param="batch_id", type_="not_found_error")
        return self.batches[batch_id]


def _new_batch(body: CreateBatchRequest) -> dict:
    now = int(time.time())
    batch = {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "in_progress",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": now,
        "expires_at": now + 24 * 3600,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }
    for event in ("finalizing", "completed", "failed", "expired", "cancelling", "cancelled"):
        batch[f"{event}_at"] = None
    return batch


def _form(content_type: str, payload: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (file name, bytes). The stdlib's MIME
    parser reads it (no multipart package is a dependency)."""
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "POST /v1/files takes multipart/form-data (fields file, purpose)")
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + payload)
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


def _request_body(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _parse_create(payload: bytes) -> CreateBatchRequest:
    """The body of POST /v1/batches; a 400 naming its first bad field."""
    try:
        return CreateBatchRequest.model_validate_json(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error.get("loc", ())) or None
        raise APIError(400, f"{field or 'body'}: {error['msg']}", param=field) from None


def register_batch_routes(app: FastAPI, server) -> None:
    """Adds the Files and Batches routes to `app`."""
    store = _Store()

    @app.post("/v1/files", responses=_CLIENT_ERROR)
    async def create_file(request: Request):
        fields = _form(request.headers.get("content-type", ""), await request.body())
        if "file" not in fields:
            raise APIError(400, "missing the multipart field 'file'", param="file")
        purpose = fields.get("purpose", (None, b""))[1].decode()
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
        name, content = fields["file"]
        return store.add_file(name or "upload.jsonl", purpose, content)

    @app.get("/v1/files", responses=_CLIENT_ERROR)
    async def list_files():
        return {"object": "list", "data": [meta for meta, _ in store.files.values()]}

    @app.get("/v1/files/{file_id}", responses=_CLIENT_ERROR)
    async def retrieve_file(file_id: str):
        return store.file(file_id)[0]

    @app.get("/v1/files/{file_id}/content", responses=_CLIENT_ERROR)
    async def file_content(file_id: str):
        return Response(store.file(file_id)[1], media_type="application/jsonl")

    @app.post(
        "/v1/batches",
        responses=_CLIENT_ERROR,
        openapi_extra={"requestBody": _request_body(CreateBatchRequest)},
    )
    async def create_batch(request: Request):
        body = _parse_create(await request.body())
        meta, content = store.file(body.input_file_id)
        if meta["purpose"] != "batch":
            raise APIError(400, "the input file's purpose is not 'batch'", param="input_file_id")
        batch = _new_batch(body)
        store.batches[batch["id"]] = batch
        task = asyncio.ensure_future(_run(app, server, store, batch, content))
        store.tasks[batch["id"]] = task
        task.add_done_callback(lambda _: store.tasks.pop(batch["id"], None))
        return batch

    @app.get("/v1/batches", responses=_CLIENT_ERROR)
    async def list_batches(limit: int = 20, after: str | None = None):
        batches = list(store.batches.values())[::-1]  # newest first, as OpenAI lists them
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        page = batches[: max(limit, 1)]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(batches) > len(page),
        }

    @app.get("/v1/batches/{batch_id}", responses=_CLIENT_ERROR)
    async def retrieve_batch(batch_id: str):
        return store.batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", responses=_CLIENT_ERROR)
    async def cancel_batch(batch_id: str):
        batch = store.batch(batch_id)
        task = store.tasks.get(batch_id)
        if task is not None and batch["status"] == "in_progress":
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            task.cancel()
        return batch


async def _run(app: FastAPI, server, store: _Store, batch: dict, content: bytes) -> None:
    """Answers the batch's lines; its result files hold what was answered, also when cancelled."""
    lines = content.decode("utf-8", errors="replace").splitlines()
    batch["request_counts"]["total"] = sum(1 for line in lines if line.strip())
    counts, outputs, errors = BatchCounts(), [], []
    try:
        async with app_client(app, server.config.api_key) as client:
            async for result in run_lines(
                client,
                lines,
                body_defaults={"priority": BATCH_PRIORITY},
                urls=[batch["endpoint"]],
                max_in_flight=max(1, server.engine.engine.args.max_num_seqs // 2),
            ):
                counts.add(result)
                (outputs if result["error"] is None else errors).append(json.dumps(result))
                batch["request_counts"].update(completed=counts.completed, failed=counts.failed)
        batch["status"] = "finalizing"
        batch["finalizing_at"] = int(time.time())
        done = "completed"
    except asyncio.CancelledError:
        done = "cancelled"
    name = batch["id"]
    for key, rows in (("output_file_id", outputs), ("error_file_id", errors)):
        if rows:
            text = "".join(row + "\n" for row in rows).encode()
            batch[key] = store.add_file(f"{name}_{key[:-8]}.jsonl", "batch_output", text)["id"]
    batch["status"], batch[f"{done}_at"] = done, int(time.time())
