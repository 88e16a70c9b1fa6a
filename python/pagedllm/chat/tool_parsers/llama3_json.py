"""`llama3_json`: Llama 3.1/3.2's JSON tool calls: the whole reply is one call or several
separated by `;`, each `{"name": ..., "parameters": {...}}`, possibly after `<|python_tag|>`
(text before that tag is content). A reply that does not start with `{` or the tag, or whose
calls do not all parse, is content."""

from __future__ import annotations

import json
from typing import Any

from pagedllm.chat.tool_parsers.base import (
    PartialCall,
    ToolParser,
    blank_to_none,
    complete_call,
    function_schemas,
    held_back,
    partial_calls,
    skip_ws,
    value_end,
)
from pagedllm.outputs import ToolCall
from pagedllm.structured_output.compiler import JSON_OPTIONS

TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


def _calls_start(text: str, final: bool) -> tuple[str, int | None]:
    """(content before the calls, index where the calls begin or None: no calls (yet))."""
    tag = text.find(TAG)
    if tag >= 0:
        return text[:tag], tag + len(TAG)
    first = skip_ws(text, 0)
    if first < len(text) and text[first] == "{":
        return "", first
    if not final and (first == len(text) or TAG.startswith(text[first:])):
        return "", None  # undecided: nothing sent yet
    return (text if final else held_back(text, TAG)), None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, start = _calls_start(text, final=True)
        if start is None:
            return blank_to_none(text), []
        calls, i = [], skip_ws(text, start)
        try:
            while i < len(text):
                end = value_end(text, i) if text[i] == "{" else None
                call = complete_call(text[i:end], _KEYS) if end is not None else None
                if call is None:
                    return blank_to_none(text), []
                calls.append(call)
                i = skip_ws(text, end)
                if i < len(text):
                    if text[i] != ";":
                        return blank_to_none(text), []
                    i = skip_ws(text, i + 1)
        except ValueError:
            return blank_to_none(text), []
        if not calls:
            return blank_to_none(text), []
        return blank_to_none(content), calls

    def partial(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        content, start = _calls_start(text, final)
        if start is None:
            return content, []
        return content, partial_calls(text, skip_ws(text, start), _KEYS, ";")

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        schema = {**function_schemas(tools, "parameters"), "x-guidance": JSON_OPTIONS}
        more = ' ("; " call)*' if parallel else ""
        return (
            f"reply: TEXT | call{more}\n"
            # free text may not start with `{`: a reply that does is a call
            "TEXT: /([^{](.|\\n)*)?/\n"
            f"call: %json {json.dumps(schema)}\n"
        )
