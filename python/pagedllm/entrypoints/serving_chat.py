"""`POST /v1/chat/completions`: the conversation rendered with the chat template, one choice per
sample; streamed `delta.content` chunks concatenate to the non-streamed message. With tools or a
reasoning parser (chat_tools.py) a reply is split into `reasoning`, `content` and `tool_calls`
(finish reason "tool_calls" when it made calls), streamed in OpenAI's delta shape: a call's
first delta has its id, type and name, the later ones pieces of its arguments (a required or
named call comes whole in one delta once complete; one cut by `max_tokens` is never a call: its
text is the content, in the last delta, with the finish reason "length").
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.chat.tools import ChatPlan, ChatRequestError, finish_reason, plan_chat
from pagedllm.entrypoints.errors import APIError, bad_request
from pagedllm.entrypoints.protocol import ChatCompletionRequest
from pagedllm.entrypoints.rendering import chat_messages, chat_tools
from pagedllm.entrypoints.serving import (
    Job,
    Server,
    continuous_usage,
    prompt_logprobs_json,
    usage,
)
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
    plan = _plan(server, body, params.structured_outputs)
    if plan.constraint is not params.structured_outputs:
        try:  # the tools' constraint, under SamplingParams' own rules
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
        except ValueError as exc:
            raise bad_request(exc) from None
    prompt = await server.prompts.chat(
        chat_messages(body),
        tools=plan.tools,
        chat_template_kwargs=body.chat_template_kwargs,
        truncate=params.truncate_prompt_tokens,
        token_ids=body.prompt_token_ids,
    )
    asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    server.prompts.check_max_tokens([prompt], max_tokens, asked)
    job = await server.submit(
        [prompt], params, priority=body.priority, timeout=body.timeout, model=body.model
    )
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _chunks(job, plan, top_n, include_usage, continuous_usage(body))
        return StreamingResponse(sse_stream(job, chunks), media_type="text/event-stream")
    finals = await job.finals(request)
    completions = [c for output in finals for c in output.outputs]
    choices = []
    for completion in completions:
        message, finish = _message(plan, completion)
        choices.append(
            {
                "index": completion.index,
                "message": message,
                "logprobs": _logprobs(completion, 0, top_n),
                "finish_reason": finish,
                "stop_reason": completion.stop_reason,
            }
        )
    num_tokens = sum(len(c.token_ids) for c in completions)
    response = _response(job, choices, "chat.completion")
    if params.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(finals[0]) if finals else None
    return response | {"usage": usage(job, num_tokens)}


def _plan(server: Server, body: ChatCompletionRequest, constraint) -> ChatPlan:
    tool_choice = body.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    try:
        return plan_chat(
            server.config.chat_options,
            tools=chat_tools(body),
            tool_choice=tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            constraint=constraint,
        )
    except ChatRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _message(plan: ChatPlan, completion) -> tuple[dict[str, Any], str | None]:
    """A completion's message and finish reason."""
    if not plan.splits:
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    split = plan.message(completion.text)
    message: dict[str, Any] = {"role": "assistant", "content": split.content}
    if plan.reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = split.reasoning
    if split.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in split.tool_calls]
    return message, finish_reason(bool(split.tool_calls), completion.finish_reason)


async def _chunks(
    job: Job, plan: ChatPlan, top_n: int, include_usage: bool, continuous: bool
) -> AsyncIterator[dict]:
    """`continuous`: each chunk carries the usage so far (continuous_usage_stats)."""
    deltas = Deltas()
    messages = {}  # choice index -> its MessageDeltas, when replies are split

    def chunk(choices: list[dict]) -> dict[str, Any]:
        out = _chunk(job, choices)
        if continuous:
            out["usage"] = usage(job, deltas.num_tokens)
        return out

    for index in range(job.params.n):  # the role first, as OpenAI sends it
        role = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
        yield chunk([choice])
    async for _, output in job.outputs():
        for completion in output.outputs:
            unsent = deltas.take(completion, completion.index)
            if unsent is None:
                continue
            text, _, token_start = unsent
            logprobs = _logprobs(completion, token_start, top_n)
            finish = completion.finish_reason
            if plan.splits:
                stream = messages.setdefault(completion.index, plan.stream())
                delta = stream.update(completion.text, finish is not None)
                if "reasoning" in delta:
                    delta["reasoning_content"] = delta["reasoning"]
                if not delta and finish is None and logprobs is None:
                    continue  # held back (a tag that may be starting): nothing to send yet
                finish = finish_reason(stream.num_calls > 0, finish)
            else:
                delta = {"content": text}
            choice = {
                "index": completion.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": completion.stop_reason,
            }
            yield chunk([choice])
    if include_usage:
        yield _chunk(job, []) | {"usage": usage(job, deltas.num_tokens)}


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
