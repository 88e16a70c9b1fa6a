"""Tool-call parsers (`--tool-call-parser NAME`): each finds the calls in a model's reply, whole
or streamed (see base.py), and gives the grammar that keeps the calls it opens well-formed."""

from __future__ import annotations

from pagedllm.chat.tool_parsers.base import PartialCall, ToolCallDeltas, ToolParser
from pagedllm.chat.tool_parsers.hermes import HermesToolParser
from pagedllm.chat.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError naming the ones there are."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}"
        )
    return parser()


__all__ = ["TOOL_PARSERS", "PartialCall", "ToolCallDeltas", "ToolParser", "get_tool_parser"]
