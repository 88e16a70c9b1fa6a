"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in free
text (Hermes, Qwen2.5, Qwen3; the built-in chat template's format). Text outside the blocks is
the message's content; a block whose JSON does not parse stays in the content."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.chat.tool_parsers.base import (
    PartialCall,
    ToolParser,
    blank_to_none,
    complete_call,
    function_schemas,
    held_back,
    partial_call,
    skip_ws,
)
from pagedllm.outputs import ToolCall
from pagedllm.structured_output.compiler import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_KEYS = ("arguments", "parameters")
# a closed block, or an unclosed one at the end (a model that stopped right after the JSON)
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls, pos = [], [], 0
        for block in _BLOCK.finditer(text):
            content.append(text[pos : block.start()])
            call = complete_call(block.group(1), _KEYS)
            if call is None:
                content.append(block.group(0))
            else:
                calls.append(call)
            pos = block.end()
        content.append(text[pos:])
        return blank_to_none("".join(content)), calls

    def partial(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        content, calls, pos = [], [], 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else held_back(tail, OPEN))
                break
            content.append(text[pos:start])
            body = skip_ws(text, start + len(OPEN))
            if body >= len(text) or text[body] != "{":
                break  # nothing of the call yet (or no JSON: it is not streamed)
            try:
                call = partial_call(text, body, _KEYS)
            except ValueError:
                break
            calls.append(call)
            if call.end is None:
                break
            close = text.find(CLOSE, call.end)
            if close < 0:
                break
            pos = close + len(CLOSE)
        return "".join(content), calls

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        schema = {**function_schemas(tools, "arguments"), "x-guidance": JSON_OPTIONS}
        # a call begins with the first `<tool_call>` after free text (lazy); with one call at
        # most, the text after it may not open another
        tail = "TEXT" if parallel else f"TEXT & ~/(.|\\n)*{OPEN}(.|\\n)*/"
        return (
            f"reply: {'call*' if parallel else 'call?'} tail\n"
            f'call: call_head "\\n" call_json "\\n{CLOSE}"\n'
            f'call_head[lazy]: TEXT "{OPEN}"\n'
            "tail: TAIL\n"
            "TEXT: /(.|\\n)*/\n"
            f"TAIL: {tail}\n"
            f"call_json: %json {json.dumps(schema)}\n"
        )
