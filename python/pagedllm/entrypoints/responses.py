"""OpenAI's `POST /v1/responses`, stateless: the input items rendered with the chat template as
a conversation (responses_protocol.py), generated under the same plan as a chat completion
(tools, tool choice, reasoning parser, structured output from `text.format`), and answered as
Responses output items: `reasoning` (the reasoning parser's thinking), `message` (the answer's
`output_text`) and `function_call` items, with `usage`. A reply cut by `max_output_tokens` (or
by the context) is `status: "incomplete"` with `incomplete_details.reason:
"max_output_tokens"`; a required or named call cut so is its text in an incomplete `message` item
(`chat.tools.cut_call_text` says why not a call). With `stream: true` the same items come as
the Responses events (responses_stream.py).

Nothing is kept between requests: `store: true` and `previous_response_id` are 400s naming the
field (a client sends the conversation back in `input`, as with `store: false`).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request

from pagedllm.chat.tools import ChatPlan, ChatRequestError, plan_chat
from pagedllm.entrypoints.errors import APIError, ErrorResponse, bad_request
from pagedllm.entrypoints.rendering import Prompt
from pagedllm.entrypoints.responses_output import (
    finished,
    output_items,
    response_status,
    split_reply,
)
from pagedllm.entrypoints.responses_protocol import (
    JsonObject,
    JsonSchema,
    ResponsesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    parse_request,
)
from pagedllm.entrypoints.responses_stream import stream_response
from pagedllm.entrypoints.serving import Job, Server
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

PATH = "/v1/responses"
_ERROR = {"model": ErrorResponse}
_RESPONSES = {
    200: {
        "description": "The response; with `stream`, server-sent Responses events",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    "4XX": {**_ERROR, "description": "A client error (400: a bad field, named)"},
    503: {**_ERROR, "description": "The engine keeps failing or is shutting down"},
}


def register_responses_route(app: FastAPI, server: Server) -> None:
    """Adds `POST /v1/responses` to `app` (its body documented from ResponsesRequest)."""

    async def responses(request: Request):
        try:
            data = await request.json()
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}") from None
        return await create_response(server, parse_request(data), request)

    body = {"content": {"application/json": {"schema": ResponsesRequest.model_json_schema()}}}
    app.post(PATH, responses=_RESPONSES, openapi_extra={"requestBody": {"required": True, **body}})(
        responses
    )


async def create_response(server: Server, body: ResponsesRequest, request: Request):
    _check_stateless(body)
    server.check_model(body.model)
    plan = _plan(server, body)
    prompt = await _prompt(server, body, plan)
    server.prompts.check_max_tokens([prompt], body.max_output_tokens, "max_output_tokens")
    # unset, the reply may run to the end of the context (OpenAI's default: no limit)
    max_tokens = body.max_output_tokens or server.engine.max_model_len - len(prompt.ids)
    params = _params(body, max_tokens, plan)
    job = await _submit(server, prompt, params, body.model)
    head = response_head(body, job, params)
    if body.stream:
        return stream_response(server, job, plan, head)
    finals = await job.finals(request)
    if not finals:  # the client went away: nobody reads an answer
        return {}
    completion = finals[0].outputs[0]
    split = split_reply(plan, completion.text)
    status = response_status(completion.finish_reason)
    items = output_items(split, status[0])
    return finished(server, head, items, status, job, len(completion.token_ids), split.reasoning)


def _check_stateless(body: ResponsesRequest) -> None:
    if body.store:
        raise APIError(
            400,
            "store: this server keeps no responses; send store=false (or leave it out) and "
            "the conversation in input",
            param="store",
        )
    if body.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id: this server keeps no responses; send the earlier items "
            "(including the previous output) in input",
            param="previous_response_id",
        )


def _param(name: str) -> str:
    """A chat-shaped field name as this body spells it."""
    if name == "structured_outputs":
        return "text.format"
    if name.startswith("messages"):
        return "input"
    return name.replace(".function.", ".")


def _plan(server: Server, body: ResponsesRequest) -> ChatPlan:
    fmt = body.text.format
    try:
        constraint = None
        if isinstance(fmt, JsonSchema):
            constraint = StructuredOutputsParams(json=fmt.json_schema)
        elif isinstance(fmt, JsonObject):
            constraint = StructuredOutputsParams(json_object=True)
    except ValueError as exc:
        raise APIError(400, f"text.format: {exc}", param="text.format") from None
    try:
        return plan_chat(
            server.config.chat_options,
            tools=chat_tools(body),
            tool_choice=chat_tool_choice(body),
            parallel_tool_calls=body.parallel_tool_calls,
            constraint=constraint,
        )
    except ChatRequestError as exc:
        message = str(exc).replace("structured_outputs or response_format", "text.format")
        raise APIError(400, message.replace(".function.", "."), param=_param(exc.param)) from None


async def _prompt(server: Server, body: ResponsesRequest, plan: ChatPlan) -> Prompt:
    messages = chat_messages(body)
    try:
        return await server.prompts.chat(messages, tools=plan.tools)
    except APIError as exc:
        if exc.param is None or not exc.param.startswith("messages"):
            raise
        message = exc.message.replace("messages[0] has", "input has")
        raise APIError(exc.status, message, param="input") from None


def _params(body: ResponsesRequest, max_tokens: int, plan: ChatPlan) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "seed": body.seed}
    for name in ("temperature", "top_p"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs, structured_outputs=plan.constraint)
    except ValueError as exc:
        raise bad_request(exc) from None


async def _submit(server: Server, prompt: Prompt, params: SamplingParams, model: str | None):
    try:
        return await server.submit([prompt], params, priority=0, timeout=None, model=model)
    except APIError as exc:
        if exc.param != "structured_outputs":
            raise
        message = exc.message.replace("structured output:", "text.format:")
        raise APIError(exc.status, message, param="text.format") from None


def response_head(body: ResponsesRequest, job: Job, params: SamplingParams) -> dict[str, Any]:
    """The response object before its output: the request's settings, echoed."""
    tool_choice = body.tool_choice or ("auto" if body.tools else "none")
    reasoning = body.reasoning.model_dump() if body.reasoning else {"effort": None}
    return {
        "id": "resp_" + uuid.uuid4().hex,
        "object": "response",
        "created_at": job.created,
        "model": job.model,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": reasoning,
        "store": False,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "usage": None,
    }


__all__ = ["PATH", "create_response", "register_responses_route"]
