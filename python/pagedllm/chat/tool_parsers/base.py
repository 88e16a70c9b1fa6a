"""What every tool-call parser shares: a forgiving scanner of JSON text that is still being
generated, the parser interface, and the differ that turns a parser's view of the text so far
into OpenAI's streamed deltas.

A parser answers two questions about a completion's text:

- `extract(text)` (the whole text): `(content, calls)`. A call whose JSON does not parse, or
  lacks a name, stays in `content`: a parser never raises on what a model wrote.
- `partial(text, final)` (the text so far): the content that is certainly content, and the
  calls begun so far, each with its name once complete and the part of its arguments text that
  is certainly in it. Both only ever grow as the text grows, so `ToolCallDeltas` can send the
  difference: a call's first delta carries its id, type and name (once), later ones pieces of
  its arguments. Concatenated, a call's pieces are its arguments text as `extract` returns it.

A call's `arguments` is the JSON text of the arguments value exactly as the model wrote it (a
JSON string value is taken as the arguments text it holds).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from pagedllm.outputs import ToolCall, tool_call_id

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
_LITERALS = ("true", "false", "null")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string starting at text[i] == '"', None if the text ends first."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], None if the text ends before it does
    (a number at the very end may go on). ValueError where the text cannot be JSON."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    match = _SCALAR.match(text, i)
    if match is None:
        if any(word.startswith(text[i:]) for word in _LITERALS):
            return None
        raise ValueError(f"not JSON at {i}")
    return None if match.end() == len(text) else match.end()


def object_members(text: str, i: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the JSON object at text[i] == '{' as far as the text goes: (key, value
    start, value end or None while incomplete) each, and the index after the object (None while
    it is open). ValueError where the text cannot be JSON."""
    n, members = len(text), []
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return members, j + 1
    while j < n:
        if text[j] != '"':
            raise ValueError(f"expected a key at {j}")
        key_end = _string_end(text, j)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= n:
            return members, None
        if text[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= n:
            return members, None
        end = value_end(text, j)
        members.append((key, j, end))
        if end is None:
            return members, None
        j = skip_ws(text, end)
        if j >= n:
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] != ",":
            raise ValueError(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return members, None


@dataclass
class PartialCall:
    """A call as far as the text goes: its name once complete, the certain part of its
    arguments text, and the index after its JSON object (None while open)."""

    name: str | None
    arguments: str
    end: int | None


def partial_call(text: str, i: int, argument_keys: tuple[str, ...]) -> PartialCall:
    """The call object `{"name": ..., <argument key>: {...}}` at text[i] == '{'."""
    members, end = object_members(text, i)
    name, arguments, has_arguments = None, "", False
    for key, start, stop in members:
        if key == "name" and stop is not None:
            value = json.loads(text[start:stop])
            name = value if isinstance(value, str) else None
        elif key in argument_keys:
            arguments, has_arguments = arguments_text(text, start, stop), True
    if end is not None and not has_arguments:
        arguments = "{}"
    return PartialCall(name, arguments, end)


def partial_calls(
    text: str, i: int, argument_keys: tuple[str, ...], separator: str
) -> list[PartialCall]:
    """The JSON calls from `text[i]` on, one after another with `separator` between them: every
    complete one and a last one still open; the list ends before a malformed one."""
    calls: list[PartialCall] = []
    try:
        while i < len(text) and text[i] == "{":
            call = partial_call(text, i, argument_keys)
            calls.append(call)
            if call.end is None:
                break
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] == separator:
                i = skip_ws(text, i + 1)
    except ValueError:
        pass
    return calls


def arguments_text(text: str, start: int, stop: int | None) -> str:
    """The arguments text of the value text[start:stop] (stop None: still open). An open object
    or array is certain up to where the text ends; an open string or scalar is not yet."""
    if stop is None:
        return text[start:] if text[start] in "{[" else ""
    raw = text[start:stop]
    if text[start] == '"':
        return json.loads(raw)
    return raw


def complete_call(body: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call in `body` (one JSON object, whitespace around it allowed), or None if it is not
    valid JSON or has no string name."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = next((value[k] for k in argument_keys if k in value), {})
    if not isinstance(args, (dict, str)):
        return None
    start = skip_ws(body, 0)
    return ToolCall(value["name"], partial_call(body, start, argument_keys).arguments)


def function_schemas(tools: list[dict[str, Any]], argument_key: str) -> dict[str, Any]:
    """A JSON schema of one call of any of `tools`: `{"name": <its name>, <argument_key>: <its
    parameters>}` (vLLM's schema, with `const` names and no other keys)."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    argument_key: tool["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", argument_key],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }


class ToolParser:
    """A tool-call format (see the module docstring). `grammar` is the Lark rules of `reply`:
    free text in which every call the model opens must be complete and valid against the tools'
    schemas (`%json` is the JSON-schema JSON dialect with the engine's JSON options)."""

    name: ClassVar[str]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def partial(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        raise NotImplementedError


def held_back(text: str, tag: str) -> str:
    """`text` without a suffix that may be the start of `tag` (sent once it is known not to be)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def blank_to_none(text: str) -> str | None:
    return text if text.strip() else None


class ToolCallDeltas:
    """One completion's streamed message pieces from `parser.partial` of the text so far."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._calls: list[tuple[str, int]] = []  # (id, arguments characters sent) per call

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the text so far."""
        content, calls = self.parser.partial(text, final)
        content_delta = content[self._content_sent :]
        self._content_sent = len(content)
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self._calls):
                if call.name is None:
                    break  # the name comes first, exactly once
                self._calls.append((tool_call_id(), len(call.arguments)))
                deltas.append(
                    {
                        "index": index,
                        "id": self._calls[index][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                continue
            call_id, sent = self._calls[index]
            if len(call.arguments) > sent:
                piece = call.arguments[sent:]
                self._calls[index] = (call_id, len(call.arguments))
                deltas.append({"index": index, "function": {"arguments": piece}})
        return content_delta, deltas
