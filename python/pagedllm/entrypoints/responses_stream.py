"""A streamed `POST /v1/responses`: server-sent events in OpenAI's order, each with its
`sequence_number`: `response.created`, `response.in_progress`; per output item
`response.output_item.added`, its content part's `response.content_part.added`, the text's
deltas (`response.output_text.delta`, or `response.reasoning_text.delta` for a reasoning item),
`.done` of the text and the part, `response.output_item.done`; a function call's
`response.function_call_arguments.delta` pieces and `.done`; last `response.completed` (or
`response.incomplete`) with the whole response, whose items are the ones streamed.

An engine failure mid-stream is an `error` event; a client that goes away aborts the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from pagedllm.chat.tools import ChatPlan
from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.responses_output import (
    call_item,
    finished,
    item_id,
    message_item,
    reasoning_item,
    response_status,
)
from pagedllm.entrypoints.serving import Job, Server
from pagedllm.entrypoints.streaming import Deltas

# the text event of each kind of item with a content part
_TEXT_EVENT = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def stream_response(server: Server, job: Job, plan: ChatPlan, head: dict) -> StreamingResponse:
    events = _events(server, job, plan, head)
    return StreamingResponse(_sse(job, events), media_type="text/event-stream")


async def _sse(job: Job, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """`event: <type>` / `data: <json>` pairs (no `[DONE]`: the Responses stream ends with its
    last event). The job is aborted unless it completed."""
    completed = False
    sequence_number = 0
    try:
        async for event in events:
            sequence_number = event["sequence_number"]
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        completed = True
    except APIError as exc:
        error = {
            "type": "error",
            "code": str(exc.status),
            "message": exc.message,
            "param": exc.param,
            "sequence_number": sequence_number + 1,
        }
        yield f"event: error\ndata: {json.dumps(error, ensure_ascii=False)}\n\n"
    finally:
        if not completed:
            job.abort()


class _Items:
    """The output items streamed so far, the open one last, and the events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open = False
        self.sequence_number = 0

    def event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.items.append(item)
        self.open = True
        events.append(self.event("response.output_item.added", **self._where(), item=_copy(item)))
        if item["type"] in _TEXT_EVENT:
            part = _copy(item["content"][0])
            events.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        return events

    def text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        """A piece of the text of a `kind` item (opened unless it is the open one)."""
        events = []
        if not (self.open and self.items[-1]["type"] == kind):
            make = message_item if kind == "message" else reasoning_item
            events = self._add(
                make(item_id("msg" if kind == "message" else "rs"), "", "in_progress")
            )
        if not delta:
            return events
        self.items[-1]["content"][0]["text"] += delta
        where = {**self._where(), "content_index": 0}
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(f"{_TEXT_EVENT[kind]}.delta", **where, delta=delta, **extra))
        return events

    def call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat-shaped tool-call delta: the first of a call opens its item."""
        events = []
        function = delta["function"]
        if "id" in delta:
            item = call_item(item_id("fc"), delta["id"], function["name"], "", "in_progress")
            events = self._add(item)
        if function.get("arguments"):
            self.items[-1]["arguments"] += function["arguments"]
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    **self._where(),
                    delta=function["arguments"],
                )
            )
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The `.done` events of the open item, which ends with `status`."""
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = "completed" if _whole_call(item) else status
        where = self._where()
        events = []
        if item["type"] in _TEXT_EVENT:
            part = item["content"][0]
            text_done = f"{_TEXT_EVENT[item['type']]}.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self.event(text_done, **where, content_index=0, text=part["text"], **extra)
            )
            events.append(
                self.event("response.content_part.done", **where, content_index=0, part=_copy(part))
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"]
                )
            )
        events.append(self.event("response.output_item.done", **where, item=_copy(item)))
        return events


def _whole_call(item: dict[str, Any]) -> bool:
    """A call whose arguments are complete JSON (a required or named call is sent whole; an
    "auto" call is streamed and may be cut)."""
    if item["type"] != "function_call":
        return False
    try:
        json.loads(item["arguments"])
    except ValueError:
        return False
    return True


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (it grows after its event was made)."""
    return json.loads(json.dumps(value))


async def _events(
    server: Server, job: Job, plan: ChatPlan, head: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    items = _Items()
    yield items.event("response.created", response=head)
    yield items.event("response.in_progress", response=head)
    deltas = Deltas()
    message = plan.stream() if plan.splits else None
    completion = None
    async for _, output in job.outputs():
        completion = output.outputs[0]
        unsent = deltas.take(completion, 0)
        if unsent is None:
            continue
        if message is None:
            delta = {"content": unsent[0]}
        else:
            delta = message.update(completion.text, completion.finish_reason is not None)
        events = []
        if delta.get("reasoning"):
            events += items.text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += items.text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += items.call(call)
        for event in events:
            yield event
    status = response_status(completion.finish_reason if completion is not None else "abort")
    if not items.items:  # nothing was said: an empty message, as a whole reply has
        for event in items.text("message", ""):
            yield event
    for event in items.close(status[0]):
        yield event
    reasoning = "".join(
        item["content"][0]["text"] for item in items.items if item["type"] == "reasoning"
    )
    num_tokens = len(completion.token_ids) if completion is not None else 0
    response = finished(server, head, items.items, status, job, num_tokens, reasoning)
    kind = "completed" if status[0] == "completed" else "incomplete"
    yield items.event(f"response.{kind}", response=response)
