"""The request body of OpenAI's `POST /v1/responses` (pydantic), and its input items as the chat
messages the chat template reads.

Field names follow OpenAI's (the `openai` package's `types/responses/`). Like the other bodies,
an undeclared field is refused (a 400 naming it) and null means the default. Input items: messages
(a string or `input_text` / `output_text` parts; `developer` is rendered as `system`),
`function_call` and `function_call_output` (a tool round trip) and `reasoning` (its text reaches
the next assistant message as `reasoning`, as the chat API's does). Images, files, audio and
OpenAI's hosted tools are refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
    model_validator,
)

from pagedllm.entrypoints.errors import APIError

Number = StrictInt | StrictFloat


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None}
        return data


class TextPart(_Body):
    """A text content part: the user's `input_text`, or an earlier reply's `output_text`."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an output_text's, sent back: not rendered
    logprobs: list[Any] | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[TextPart]
    id: StrictStr | None = None
    status: StrictStr | None = None
    phase: StrictStr | None = None


class FunctionCallItem(_Body):
    """A call an earlier response made, sent back with its output."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # the arguments object as JSON text
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[TextPart]
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None


def _item_type(value: Any) -> str | None:
    """An item's `type`; a message may leave it out (OpenAI's "easy" input message)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    """OpenAI's flattened function tool (no `function` wrapper as in the chat API)."""

    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # accepted; forced calls are always constrained


class NamedFunction(_Body):
    type: Literal["function"]
    name: StrictStr


class PlainText(_Body):
    type: Literal["text"]


class JsonObject(_Body):
    type: Literal["json_object"]


class JsonSchema(_Body):
    type: Literal["json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    # "schema" shadows a BaseModel attribute: read under another name
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Body):
    format: PlainText | JsonObject | JsonSchema = Field(
        default_factory=lambda: PlainText(type="text"), discriminator="type"
    )
    verbosity: StrictStr | None = None  # accepted, without effect


class ReasoningConfig(_Body):
    """Accepted, without effect: how much a model thinks is up to its chat template here."""

    effort: StrictStr | None = None
    summary: StrictStr | None = None
    generate_summary: StrictStr | None = None


class ResponsesRequest(_Body):
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    reasoning: ReasoningConfig | None = None
    stream: StrictBool = False
    # nothing is kept between requests: store=true and previous_response_id are refused (400)
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    # accepted, without effect (they steer OpenAI's platform)
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    truncation: Literal["disabled"] | None = None
    include: list[StrictStr] | None = None
    # pagedllm's, as on the other routes: a seed for sampling
    seed: StrictInt | None = None


# the body's field names, as the client spells them (pydantic's error locations use them)
_FIELDS = frozenset(
    info.alias or name
    for model in (ResponsesRequest, MessageItem, FunctionCallItem, FunctionCallOutputItem)
    + (ReasoningItem, ReasoningText, TextPart, FunctionTool, NamedFunction, TextConfig)
    + (JsonSchema, ReasoningConfig)
    for name, info in model.model_fields.items()
)


def _path(loc: tuple[str | int, ...]) -> str:
    """`input[2].call_id`: where in the body a pydantic error is (union tags left out)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in _FIELDS:
            text += f".{part}" if text else part
    return text


def _lone_surrogate(data: Any) -> str | None:
    """Where the first string holding a lone surrogate is (valid JSON, not Unicode: no
    tokenizer can encode it), or None."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return _path(loc) or "body"
        elif isinstance(value, dict):
            stack.extend((inner, (*loc, key)) for key, inner in value.items())
        elif isinstance(value, list):
            stack.extend((inner, (*loc, i)) for i, inner in enumerate(value))
    return None


def parse_request(data: Any) -> ResponsesRequest:
    """The body as a ResponsesRequest; a 400 naming the first bad field."""
    where = _lone_surrogate(data)
    if where is not None:
        raise APIError(400, f"{where}: a lone surrogate is not valid Unicode", param=where)
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        problems: dict[str, list[str]] = {}
        for error in exc.errors():
            loc = error.get("loc", ())
            param = _path(loc) or "body"
            if error.get("type") == "extra_forbidden":
                message = "not a field of a Responses request"
                param = _path(loc[:-1]) + (f".{loc[-1]}" if loc[:-1] else str(loc[-1]))
            elif error.get("type") == "union_tag_not_found":
                message = "an input item must be an object (a message, or one with a type)"
            elif error.get("type") == "union_tag_invalid":
                tag = error.get("ctx", {}).get("tag")
                message = (
                    f"unknown item type {tag!r}; this server takes message, function_call, "
                    "function_call_output and reasoning items"
                )
            else:
                message = error.get("msg", "invalid")
            problems.setdefault(param, [])
            if message not in problems[param]:
                problems[param].append(message)
        # a union's other branch ("should be a string") under a deeper, more telling error
        deeper = [p for p in problems if any(q.startswith(p) and q != p for q in problems)]
        for param in deeper:
            del problems[param]
        text = "; ".join(f"{p}: {' or '.join(m)}" for p, m in list(problems.items())[:5])
        first = next(iter(problems), "body")
        raise APIError(400, text, param=None if first == "body" else first) from None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: `instructions` as a system message first; a
    function call joins the assistant message before it (a call's arguments must be JSON, a
    call output must answer a call made earlier in `input`)."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    calls: set[str] = set()
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(body.input):
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or item.summary)
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except ValueError:
                raise APIError(
                    400,
                    f"input[{i}].arguments is not JSON: {item.arguments[:80]!r}",
                    param=f"input[{i}].arguments",
                ) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise APIError(
                    400,
                    f"input[{i}].call_id {item.call_id!r} answers no function_call item "
                    "earlier in input",
                    param=f"input[{i}].call_id",
                )
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
        if messages[-1]["role"] == "assistant" and reasoning is not None:
            messages[-1]["reasoning"] = messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    if not messages:
        raise APIError(400, "input holds no message, call or call output", param="input")
    return messages


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The flattened function tools in the chat API's shape (what `plan_chat` checks)."""
    return [
        {
            "type": "function",
            "function": tool.model_dump(exclude_none=True, exclude={"type", "strict"}),
        }
        for tool in body.tools or ()
    ]


def chat_tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice
