"""The output of `POST /v1/responses`: a reply split into Responses output items (`reasoning`,
`message` with its `output_text`, `function_call`), its status and its usage; the same items
for a whole reply and, item by item, for a streamed one."""

from __future__ import annotations

import uuid
from typing import Any

from pagedllm.chat.tools import ChatPlan, Message
from pagedllm.entrypoints.serving import Job, Server


def split_reply(plan: ChatPlan, text: str) -> Message:
    """The reply as reasoning, answer and calls (all answer without parsers)."""
    if not plan.splits:
        return Message(None, text, [])
    return plan.message(text)


def response_status(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a reply that finished so: cut by its token limit, it is
    incomplete (OpenAI's reason); aborted (a timeout, the server shutting down) too."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(id_: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": id_,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def reasoning_item(id_: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": id_, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(id_: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": id_,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(split: Message, status: str) -> list[dict[str, Any]]:
    """The output items of a whole reply; in a cut one the last text is incomplete (a forced
    call cut short is that text, after the calls made before it: `chat.tools.cut_call_text`)."""
    items = []
    if split.reasoning:
        items.append(reasoning_item(item_id("rs"), split.reasoning, "completed"))
    message = None
    if split.content or not split.tool_calls:
        message = message_item(item_id("msg"), split.content or "", "completed")
    if message is not None and not split.cut_call:
        items.append(message)
    for call in split.tool_calls:
        items.append(call_item(item_id("fc"), call.id, call.name, call.arguments, "completed"))
    if message is not None and split.cut_call:
        items.append(message)
    # a cut reply's text is cut; its calls are whole (a cut call is no call)
    if status != "completed" and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"
    return items


def finished(
    server: Server,
    head: dict[str, Any],
    items: list[dict[str, Any]],
    status: tuple[str, dict | None],
    job: Job,
    num_output_tokens: int,
    reasoning: str | None,
) -> dict[str, Any]:
    """The whole response object: its output items, status and usage."""
    return head | {
        "status": status[0],
        "incomplete_details": status[1],
        "output": items,
        "usage": _usage(server, job, num_output_tokens, reasoning),
    }


def _usage(server: Server, job: Job, num_output_tokens: int, reasoning: str | None) -> dict:
    """OpenAI's Responses usage; `reasoning_tokens`: the thinking's text tokenized again (the
    tokens a model wrote for it, unless it tokenized it unusually)."""
    reasoning_tokens = 0
    tokenizer = server.engine.tokenizer
    if reasoning and tokenizer is not None:
        ids = tokenizer.encode(reasoning, add_special_tokens=False)
        reasoning_tokens = min(len(ids), num_output_tokens)
    return {
        "input_tokens": job.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": job.num_cached_tokens},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": job.num_prompt_tokens + num_output_tokens,
    }
