"""Tools, `tool_choice` and reasoning for one chat request: what the template renders, which
constraint the request samples under, and how its reply becomes a message (`reasoning`,
`content`, `tool_calls`), whole or streamed. The server and `LLM.chat` both plan here.

`tool_choice` (vLLM's rules, OpenAI's wire format):
- `"none"`: no calls are parsed; the tools are still rendered into the prompt (as vLLM does)
  unless `exclude_tools_when_tool_choice_none`.
- `"required"`: the reply is constrained to a JSON array of at least one call (at most one
  with `parallel_tool_calls=False`), `[{"name": <a tool's name>, "parameters": {...}}]`, each
  valid against its tool's schema; named (`{"type": "function", "function": {"name": N}}`):
  the reply is constrained to N's arguments. Either way the arguments always parse and
  validate. Neither combines with a request's own constraint. A reply cut short (max_tokens,
  a stop string) keeps the calls completed before the cut; the cut call's JSON text becomes the
  message's `content` (after the calls), with the finish reason "length", so nothing generated
  is lost and no call with arguments that do not parse is ever returned (see `cut_call_text`).
  Streamed, a call is sent whole (id, name and all of its arguments in one delta) once its JSON
  object closes, and a cut call's text comes as content in the last delta, so the streamed
  pieces always add up to the whole answer.
- `"auto"` (the default when tools are given): needs a tool parser (`--enable-auto-tool-choice
  --tool-call-parser NAME`). The model writes freely, but once it opens a call (hermes:
  `<tool_call>`; llama3_json: a reply starting with `{`) the grammar holds the rest of the call
  to the tools' schemas, so an opened call cannot come out malformed. A request's own
  constraint (`structured_outputs`, `response_format`) replaces that grammar.

With a reasoning parser the constraint applies to the answer after `</think>` (the grammar
lets the model think first), unless `enable_in_reasoning` (vLLM's
`--structured-outputs-config '{"enable_in_reasoning": true}'`): then it applies from the first
token. A Lark/GBNF `grammar` constraint cannot be put after the thinking: it needs
`enable_in_reasoning`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from pagedllm.chat.reasoning_parsers import ReasoningParser, get_reasoning_parser
from pagedllm.chat.tool_parsers import ToolCallDeltas, ToolParser, get_tool_parser
from pagedllm.chat.tool_parsers.base import (
    PartialCall,
    arguments_text,
    blank_to_none,
    partial_calls,
    skip_ws,
    value_end,
)
from pagedllm.outputs import ToolCall
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.compiler import grammar_text, short_error

TOOL_CHOICES = ("none", "auto", "required")


class ChatRequestError(ValueError):
    """A bad tools / tool_choice / template request; `param` is the field to name (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatOptions:
    """Server-wide (the serve flags) or `LLM.chat`'s: parsers and structured-output placement."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the parsers there are
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")


def structured_outputs_config(text: str | dict | None) -> dict[str, Any]:
    """`--structured-outputs-config JSON`: the keys this server takes (enable_in_reasoning)."""
    config = json.loads(text) if isinstance(text, str) else (text or {})
    if not isinstance(config, dict):
        raise ValueError("--structured-outputs-config must be a JSON object")
    unknown = sorted(set(config) - {"enable_in_reasoning"})
    if unknown:
        raise ValueError(
            f"--structured-outputs-config: unknown keys {unknown}; supported: enable_in_reasoning"
        )
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise ValueError("--structured-outputs-config: enable_in_reasoning must be true or false")
    return config


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as plain dicts (`{"type": "function", "function": {...}}`), names unique, each
    parameters schema one the grammar engine takes; ChatRequestError naming `tools[i]...`."""
    if not tools:
        return None
    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise ChatRequestError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                f"tools[{i}]",
            )
        if name in seen:
            raise ChatRequestError(f"tools[{i}]: a second tool named {name!r}", f"tools[{i}]")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None:
            where = f"tools[{i}].function.parameters"
            try:
                # the structured-output rules of a JSON schema, in their one place
                error = llguidance.LLMatcher.validate_grammar(
                    grammar_text(*StructuredOutputsParams(json=parameters).key)
                )
            except ValueError as exc:
                error = str(exc)
            if error:
                raise ChatRequestError(f"{where}: {short_error(error)}", where)
    return tools


class RequiredCalls(ToolParser):
    """`tool_choice="required"`: the reply is `[{"name": ..., "parameters": {...}}, ...]`; only
    complete calls are calls (the grammar makes each valid, but a cut one is not a call: its
    text is content, `cut_call_text`)."""

    name = "required"
    _KEYS = ("parameters", "arguments")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = self._whole_calls(text)
        try:
            items = json.loads(text)
        except ValueError:
            if text.lstrip().startswith("["):  # the array cut short: the calls made before
                return cut_call_text(text, calls[-1].end if calls else None), [
                    ToolCall(call.name, call.arguments) for call in calls
                ]
            return blank_to_none(text), []
        valid = (
            isinstance(items, list)
            and len(items) == len(calls) > 0
            and all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items)
        )
        if not valid:
            return blank_to_none(text), []
        return None, [ToolCall(call.name, call.arguments) for call in calls]

    def partial(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        # the content (a cut call's text) is known only at the end: the whole reply's own
        content = (self.extract(text)[0] or "") if final else ""
        return content, self._whole_calls(text)

    def _whole_calls(self, text: str) -> list[PartialCall]:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return []
        calls = partial_calls(text, skip_ws(text, i + 1), self._KEYS, ",")
        return [call for call in calls if call.end is not None and call.name is not None]

    @staticmethod
    def schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """vLLM's schema of a required choice: an array of calls of any of the tools."""
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": tool["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return schema | ({} if parallel else {"maxItems": 1})


class NamedCall(ToolParser):
    """A named tool choice: the whole reply is the arguments of that function, a call once
    they are complete (cut short, there is no call: the text is content, `cut_call_text`)."""

    def __init__(self, name: str) -> None:
        self.function = name

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            value = json.loads(text)
        except ValueError:
            if text.lstrip()[:1] in ("{", '"'):  # the arguments cut short: no call
                return cut_call_text(text, None), []
            return blank_to_none(text), []
        if not isinstance(value, (dict, str)):
            return blank_to_none(text), []
        i = skip_ws(text, 0)
        return None, [ToolCall(self.function, arguments_text(text, i, value_end(text, i)))]

    def partial(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        # the content (the cut arguments' text) is known only at the end: the whole reply's own
        content = (self.extract(text)[0] or "") if final else ""
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] not in '{"':
            return content, []
        try:
            end = value_end(text, i)
        except ValueError:
            return content, []
        if end is None:  # open: sent whole once it closes (a cut must not leave a call sent)
            return content, []
        return content, [PartialCall(self.function, arguments_text(text, i, end), end)]


def cut_call_text(text: str, after: int | None) -> str | None:
    """The text of a forced call cut short (from the end of the last whole call, `after`, or
    the whole reply), shown as the message's content.

    Why text and not a call with cut arguments: OpenAI's chat API returns such a call (its
    arguments do not parse, finish reason "length") and the Responses API documents a
    `function_call` item `status: "incomplete"`; but a call whose name was cut cannot be one at
    all, a client that runs every call it gets would run arguments that do not parse, and
    "required" / named calls here promise arguments that parse and validate. vLLM returns the
    raw text as the message; so does this, with the finish reason "length" (Responses: a
    `message` item `status: "incomplete"` in a response `incomplete` for `max_output_tokens`),
    so the generated text is never dropped."""
    rest = text if after is None else text[after:].lstrip(" \t\r\n,")
    return blank_to_none(rest)


def finish_reason(made_calls: bool, finish: str | None) -> str | None:
    """A reply that ended by itself ("stop") having made calls finishes with "tool_calls"."""
    return "tool_calls" if made_calls and finish == "stop" else finish


@dataclass
class Message:
    """A reply split as the chat API returns it. `cut_call`: `content` is the text of a forced
    call cut short (`cut_call_text`), which came after the calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    cut_call: bool = False


class ChatPlan:
    """One request's tools and reasoning: `tools` to render, the `constraint` to sample under,
    and `message` / `stream` to read its replies."""

    def __init__(
        self,
        tools: list[dict[str, Any]] | None,
        constraint: StructuredOutputsParams | None,
        tool_parser: ToolParser | None,
        reasoning: ReasoningParser | None,
    ) -> None:
        self.tools = tools
        self.constraint = constraint
        self.tool_parser = tool_parser
        self.reasoning = reasoning

    @property
    def splits(self) -> bool:
        """Whether replies are read as more than their text."""
        return self.tool_parser is not None or self.reasoning is not None

    def message(self, text: str) -> Message:
        reasoning, answer = (None, text) if self.reasoning is None else self.reasoning.split(text)
        if self.tool_parser is None:
            return Message(reasoning, answer or None, [])
        content, calls = self.tool_parser.extract(answer)
        forced = isinstance(self.tool_parser, (RequiredCalls, NamedCall))
        return Message(reasoning, content, calls, cut_call=forced and content is not None)

    def stream(self) -> MessageDeltas:
        return MessageDeltas(self)


class MessageDeltas:
    """One streamed reply's deltas: `update(text so far, final)` gives the new reasoning,
    content and tool-call pieces (OpenAI's delta shape for `tool_calls`)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self._reasoning_sent = 0
        self._calls = ToolCallDeltas(plan.tool_parser) if plan.tool_parser is not None else None
        self._content_sent = 0

    @property
    def num_calls(self) -> int:
        return 0 if self._calls is None else self._calls.num_calls

    def update(self, text: str, final: bool) -> dict[str, Any]:
        reasoning = self.plan.reasoning
        thinking, answer = ("", text) if reasoning is None else reasoning.partial(text, final)
        delta: dict[str, Any] = {}
        if len(thinking) > self._reasoning_sent:
            delta["reasoning"] = thinking[self._reasoning_sent :]
            self._reasoning_sent = len(thinking)
        if self._calls is None:
            content, calls = answer[self._content_sent :], []
            self._content_sent = len(answer)
        else:
            content, calls = self._calls.update(answer, final)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def plan_chat(
    options: ChatOptions,
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool = True,
    constraint: StructuredOutputsParams | None = None,
) -> ChatPlan:
    """The plan of one request (`tool_choice` None: "auto" with tools, as vLLM and OpenAI
    default); ChatRequestError naming the field for a request that cannot be served."""
    tools = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice != "none" and not tools:
        raise ChatRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    reasoning = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
    parser: ToolParser | None = None
    reply: str | None = None  # Lark rules of `reply`, when the tools constrain it
    if tool_choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise ChatRequestError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                "--tool-call-parser NAME",
                "tool_choice",
            )
        parser = get_tool_parser(options.tool_call_parser)
        if constraint is None:
            reply = parser.grammar(tools, parallel_tool_calls)
    elif tool_choice != "none":
        if constraint is not None:
            raise ChatRequestError(
                'tool_choice "required" or a named function cannot be combined with '
                "structured_outputs or response_format",
                "tool_choice",
            )
        if tool_choice == "required":
            parser = RequiredCalls()
            constraint = StructuredOutputsParams(
                json=RequiredCalls.schema(tools, parallel_tool_calls)
            )
        else:
            name = tool_choice["function"]["name"]
            tool = next((t for t in tools if t["function"]["name"] == name), None)
            if tool is None:
                raise ChatRequestError(
                    f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
                )
            parser = NamedCall(name)
            constraint = StructuredOutputsParams(
                json=tool["function"].get("parameters") or {"type": "object"}
            )
    if reasoning is not None and not options.enable_in_reasoning:
        if reply is None and constraint is not None:
            reply = _reply_rules(constraint)
        if reply is not None:
            constraint = StructuredOutputsParams(grammar=reasoning.grammar() + reply)
    elif reply is not None:
        constraint = StructuredOutputsParams(grammar="start: reply\n" + reply)
    return ChatPlan(rendered_tools(options, tools, tool_choice), constraint, parser, reasoning)


def rendered_tools(
    options: ChatOptions, tools: list[dict[str, Any]] | None, tool_choice: Any
) -> list[dict[str, Any]] | None:
    """The tools the chat template is given (None: none), as `plan_chat` renders them; a router
    renders the replica's prompt with it without planning the reply."""
    if not tools or (tool_choice == "none" and options.exclude_tools_when_tool_choice_none):
        return None
    return tools


def _reply_rules(params: StructuredOutputsParams) -> str:
    """A constraint as the Lark rule `reply`, to follow the thinking."""
    kind, spec = params.key
    if kind == "grammar":
        raise ChatRequestError(
            "a grammar constraint cannot be placed after the reasoning; write the thinking into "
            "the grammar and start the server with --structured-outputs-config "
            "'{\"enable_in_reasoning\": true}'",
            "structured_outputs",
        )
    if kind == "choice":
        choices = " | ".join(json.dumps(c) for c in json.loads(spec))
        return f"reply: CHOICE\nCHOICE: {choices}\n"
    # the grammar engine's own text of it (its JSON options and regex escaping)
    try:
        grammar = json.loads(grammar_text(kind, spec))["grammars"][0]
    except ValueError as exc:
        raise ChatRequestError(f"structured output: {exc}", "structured_outputs") from None
    if grammar.get("json_schema") is not None:
        return f"reply: %json {json.dumps(grammar['json_schema'])}\n"
    return "reply: " + grammar["lark_grammar"].removeprefix("start: ") + "\n"
