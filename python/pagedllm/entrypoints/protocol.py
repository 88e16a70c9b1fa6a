"""Request bodies of the OpenAI API (pydantic), with vLLM's extra sampling fields.

Every body object (`_Body`) takes `null` for an optional field as its default, as OpenAI's API
does, and refuses a string holding a lone surrogate (`"\\ud800"` is valid JSON but not Unicode:
no tokenizer, grammar or response can encode it) with a 400 naming where it is.

A field a body does not declare is a 400 naming it (`extra="forbid"`, mapped by
`unknown_field`): a request is never served with part of it silently dropped. The fields in
`NO_OP_FIELDS` are declared and accepted but change nothing here (they steer OpenAI's platform:
storage, billing tiers, abuse monitoring). Chat messages stay open, as OpenAI's are: a key such
as `name` reaches the chat template.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagedllm.sampling_params import SamplingParams

Number = StrictInt | StrictFloat


def _path(parts: tuple[str | int, ...]) -> str:
    """`messages[0].content`: a location in the request body, as errors name it."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else part
    return text


_TEXT_OR_CONTAINER = frozenset((str, list, dict))  # the JSON values a surrogate can hide in


def _lone_surrogate(value: Any, field: str) -> str | None:
    """Where the first lone surrogate in a JSON value is, or None. Iterative: a value nested
    deeper than Python's recursion limit is walked like any other."""
    if not isinstance(value, (str, list, dict)) or (isinstance(value, str) and value.isascii()):
        return None  # the usual field, at once (isascii is O(1))
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, (field,))]
    while stack:
        item, parts = stack.pop()
        if isinstance(item, str):
            if item.isascii():
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                code_point = ord(item[exc.start])
                return f"(U+{code_point:04X}) at index {exc.start} of {_path(parts)}"
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                stack.append((inner, (*parts, key)))
                stack.append((key, (*parts, "<key>")))
        elif isinstance(item, list) and _TEXT_OR_CONTAINER.intersection(map(type, item)):
            # (a list of token ids is passed over at C speed: 100k ids in ~2 ms)
            for i in range(len(item) - 1, -1, -1):
                if type(item[i]) in _TEXT_OR_CONTAINER:
                    stack.append((item[i], (*parts, i)))
    return None


def _nullable_properties(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The OpenAPI document says what `_Body` accepts: null for every optional field."""
    for name, prop in schema.get("properties", {}).items():
        field = model.model_fields.get(name) or next(
            (f for f in model.model_fields.values() if f.alias == name), None
        )
        if field is None or field.is_required():
            continue
        branches = prop.get("anyOf")
        if branches is None:
            meta = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}
        elif {"type": "null"} not in branches:
            branches.append({"type": "null"})


class _Body(BaseModel):
    """A body object: null for an optional field means its default; an undeclared field is an
    error."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_nullable_properties)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        required = cls._required()
        return {k: v for k, v in data.items() if v is not None or k in required}

    @classmethod
    @functools.cache
    def _required(cls) -> frozenset[str]:
        return frozenset(f.alias or n for n, f in cls.model_fields.items() if f.is_required())


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # vLLM's: usage (tokens so far) in every chunk, not only in a final one
    continuous_usage_stats: StrictBool = False


# Accepted, documented, and without effect on this server (see the module docstring)
NO_OP_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
)


class _SamplingFields(_Body):
    """What both requests take. Each field's raw value is checked for lone surrogates once, here
    (nested objects included), before anything reads it."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        found = _lone_surrogate(value, info.field_name or "")
        if found is not None:
            raise PydanticCustomError(
                "invalid_unicode", "a lone surrogate {where} is not valid Unicode", {"where": found}
            )
        return value

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # NO_OP_FIELDS: accepted, no effect (prefix caching needs no prompt_cache_key)
    user: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    # OpenAI's: token id (as a string) -> bias, clipped to [-100, 100]
    logit_bias: dict[StrictStr, Number] | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    prompt_logprobs: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    # vLLM's structured output: {"json": schema} | {"regex": ...} | {"choice": [...]} | ...
    structured_outputs: dict[str, Any] | None = None
    # pagedllm's: seconds after which the request ends with finish reason "abort"
    timeout: Number | None = Field(default=None, gt=0)


class CompletionRequest(_SamplingFields):
    # the first branch that fits, token ids before strings: in pydantic's default "smart" mode a
    # 100k-token prompt first failed list[str] element by element (84 ms, not 7)
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(
        union_mode="left_to_right"
    )
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    # pagedllm's: each prompt's token ids, run in place of tokenizing it (a router sends them;
    # checked as token-id prompts are; a text prompt is still what `echo` returns)
    prompt_token_ids: list[list[StrictInt]] | None = None
    # vLLM's beam search: best_of (else n) beams, the n best returned
    use_beam_search: StrictBool = False
    length_penalty: Number = 1.0


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    # "schema" shadows a BaseModel attribute: read under another name
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ToolCallFunction(_Body):
    name: StrictStr
    arguments: StrictStr  # the arguments object as JSON text (OpenAI's shape)


class MessageToolCall(_Body):
    """A call an earlier assistant message made, sent back for the next turn."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction
    # a streamed call's position, which clients that accumulate deltas send back: ignored
    index: StrictInt | None = None


class ChatMessage(_Body):
    # open, as OpenAI's messages are: other keys (`name`, ...) reach the chat template
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    # an assistant's calls, and a tool message's answer to one of them
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # an assistant's thinking, as this server returned it (vLLM's name and the older one)
    reasoning: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    refusal: StrictStr | None = None  # in OpenAI's assistant messages; not rendered


class FunctionDefinition(_Body):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # accepted; calls are always constrained when forced


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    # OpenAI's newer name for max_tokens; given, it is the one that counts
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    # tool calling (see chat_tools.py): tool_choice defaults to "auto" when tools are given
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # extra variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # pagedllm's: the conversation's token ids, run in place of rendering `messages` (a router
    # sends them; checked as a token-id prompt is)
    prompt_token_ids: list[StrictInt] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_tokens_rule(cls, value: int | None) -> int | None:
        # the engine's rule for max_tokens, checked here so that 0 is refused under the name the
        # client sent instead of falling back to max_tokens
        if value is not None:
            SamplingParams(max_tokens=value)
        return value


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a `prompt` (special tokens added unless `add_special_tokens` is
    false), or chat `messages` (tokenized as `/v1/chat/completions` does)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    # rendered with messages, as vLLM's /tokenize does
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def _field_names() -> frozenset[str]:
    names, models = set(), [_Body]
    while models:
        model = models.pop()
        models.extend(model.__subclasses__())
        for name, field in model.model_fields.items():
            names.update((name, field.alias or name))
    return frozenset(names)


_FIELD_NAMES = _field_names()


def param_of(loc: tuple[str | int, ...]) -> str | None:
    """The field a pydantic error location names (`messages[0].role`): the request fields and
    list indices in it, without pydantic's union branch tags (`temperature.float`)."""
    parts = tuple(p for p in loc if isinstance(p, int) or p in _FIELD_NAMES)
    return _path(parts) or None


def unknown_field(loc: tuple[str | int, ...]) -> tuple[str, str]:
    """(the field, the message) for a field the body does not declare (pydantic's
    `extra_forbidden` at `loc`)."""
    *known, name = loc[1:] if loc and loc[0] == "body" else loc
    param = _path((*(p for p in known if isinstance(p, int) or p in _FIELD_NAMES), name))
    accepted = ", ".join(NO_OP_FIELDS)
    return param, f"not a field this server supports (accepted without effect: {accepted})"
