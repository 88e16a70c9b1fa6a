"""`POST /v1/chat/completions`: the conversation rendered with the chat template, one choice per
sample; streamed `delta.content` chunks concatenate to the non-streamed message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.protocol import ChatCompletionRequest
from pagedllm.entrypoints.serving import Job, Server, usage
from pagedllm.entrypoints.streaming import Deltas, sse_stream


async def create_chat_completion(server: Server, body: ChatCompletionRequest, request: Request):
    server.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    top_n = body.top_logprobs or 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = server.sampling_params(
        body, max_tokens=max_tokens, logprobs=top_n if body.logprobs else None
    )
    prompt = await server.chat_prompt([m.model_dump() for m in body.messages])
    asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    server.check_max_tokens([prompt], max_tokens, asked)
    job = await server.submit(
        [prompt], params, priority=body.priority, timeout=body.timeout, model=body.model
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(job, top_n, include_usage)
        return StreamingResponse(sse_stream(job, chunks), media_type="text/event-stream")
    finals = await job.finals(request)
    completions = [c for output in finals for c in output.outputs]
    choices = [
        {
            "index": completion.index,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": _logprobs(completion, 0, top_n),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        for completion in completions
    ]
    num_tokens = sum(len(c.token_ids) for c in completions)
    response = _response(job, choices, "chat.completion")
    return response | {"usage": usage(job.num_prompt_tokens, num_tokens)}


async def _chunks(job: Job, top_n: int, include_usage: bool) -> AsyncIterator[dict]:
    for index in range(job.params.n):  # the role first, as OpenAI sends it
        role = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
        yield _chunk(job, [choice])
    deltas = Deltas()
    async for _, output in job.outputs():
        for completion in output.outputs:
            unsent = deltas.take(completion, completion.index)
            if unsent is None:
                continue
            delta, _, token_start = unsent
            choice = {
                "index": completion.index,
                "delta": {"content": delta},
                "logprobs": _logprobs(completion, token_start, top_n),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            yield _chunk(job, [choice])
    if include_usage:
        yield _chunk(job, []) | {"usage": usage(job.num_prompt_tokens, deltas.num_tokens)}


def _chunk(job: Job, choices: list[dict]) -> dict[str, Any]:
    return _response(job, choices, "chat.completion.chunk")


def _response(job: Job, choices: list[dict], kind: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{job.id}",
        "object": kind,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }


def _logprobs(completion, start: int, top_n: int) -> dict[str, Any] | None:
    """OpenAI's chat logprobs of tokens [start:] of a completion, `top_n` alternatives each."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token else ""
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob if chosen is not None else None,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [_alternative(lp) for _, lp in ranked],
            }
        )
    return {"content": content}


def _alternative(lp) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
