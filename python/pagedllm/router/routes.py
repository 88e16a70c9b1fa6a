"""What the router does for the routes beyond completions and chat: the prompt a Responses,
embeddings, score or rerank request is routed by (the prefix-aware policy needs its token ids),
and the one answer of a runtime LoRA load or unload sent to every replica.

The bodies go to the replica as the client sent them (these routes take no `prompt_token_ids`);
the ids only choose the replica. A Responses request is rendered as its replica renders it (its
input items as chat messages, its tools); an embeddings request is routed by its first input, a
score or rerank request by its query (the part every pair of the request starts with).
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from pagedllm.chat.tools import rendered_tools
from pagedllm.entrypoints.rendering import Renderer
from pagedllm.entrypoints.responses_protocol import (
    ResponsesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
)

RESPONSES = "/v1/responses"
# forwarded with the router's policy: the prompt's ids from `routing_ids` / `routing_text`
PROMPT_ROUTES = (
    RESPONSES,
    "/v1/embeddings",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
)
# sent to every replica: an adapter is loaded (or unloaded) everywhere or the answer says where not
BROADCAST_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def routing_text(path: str, body: dict) -> str | list[int] | None:
    """The text (or token ids) a request of `path` is routed by; None: none found (the replica
    answers the body's error)."""
    if path == RESPONSES:
        given = body.get("input")
        return given if isinstance(given, str) else None
    if path.endswith("/embeddings"):
        given = body.get("input")
        if isinstance(given, list) and given and isinstance(given[0], (str, list)):
            given = given[0]
    elif path.endswith("score"):
        given = body.get("text_1", body.get("queries"))
        if isinstance(given, list) and given:
            given = given[0]
    else:  # rerank
        given = body.get("query")
    if isinstance(given, str):
        return given
    if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
        return given
    return None


def routing_ids(renderer: Renderer, path: str, body: dict) -> list[int]:
    """The token ids a request of `path` is routed by, as its replica would tokenize them
    ([] when there are none: the replica answers the body's error)."""
    if path == RESPONSES:
        try:
            request = ResponsesRequest.model_validate(body)
        except ValidationError:
            return []
        options = renderer.chat_options
        tools = rendered_tools(options, chat_tools(request), chat_tool_choice(request))
        try:
            return renderer.encode_chat(renderer.render(chat_messages(request), tools=tools))
        except Exception:  # noqa: BLE001 - the replica answers the template's error itself
            return []
    given = routing_text(path, body)
    if isinstance(given, str):
        return renderer.encode(given)
    return given or []


def broadcast_answer(
    path: str, answers: list[tuple[int, int | None, bytes]]
) -> tuple[int, bytes, bool]:
    """One answer to a runtime LoRA call sent to every replica, from each replica's (index,
    status or None when it was not reached, body): every replica's 2xx -> the first one's;
    every replica's same 4xx -> that answer unchanged (the client's mistake, say a missing
    adapter folder); anything else -> a 502 naming what happened on each replica (the adapter
    is not served the same everywhere: retry, or undo it where it succeeded). The flag: the
    answer is the first replica's own (its content type applies)."""
    statuses = {status for _, status, _ in answers}
    if len(statuses) == 1 and None not in statuses:
        (status,) = statuses
        if status < 300 or 400 <= status < 500:
            return status, answers[0][2], True
    outcomes = [
        {"replica": index, "status": status, "detail": _detail(status, content)}
        for index, status, content in answers
    ]
    ok = [o for o in outcomes if o["status"] is not None and o["status"] < 300]
    done = ", ".join(str(o["replica"]) for o in ok)
    failed = "; ".join(f"replica {o['replica']}: {o['detail']}" for o in outcomes if o not in ok)
    action = "loaded" if path.endswith("/load_lora_adapter") else "unloaded"
    message = f"{path} failed on some replicas ({action} on [{done}] only): {failed}"
    error = {"message": message, "type": "partial_failure", "code": 502, "replicas": outcomes}
    return 502, json.dumps({"error": error}).encode(), False


def _detail(status: int | None, content: bytes) -> str:
    if status is None:
        return content.decode(errors="replace") or "not reached"
    try:
        message = json.loads(content).get("error", {}).get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{status} {message}" if message else str(status)


def stream_failure(path: str, message: str) -> bytes:
    """The last event of a stream whose replica failed after its first byte: a Responses
    `error` event, or a completions stream's error chunk and `[DONE]`."""
    if path == RESPONSES:
        event = {"type": "error", "code": "502", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    event = {"error": {"message": message, "type": "bad_gateway", "code": 502}}
    return f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
