"""One constraint (`StructuredOutputsParams`) to a compiled llguidance matcher.

JSON settings: llguidance's JSON grammar escapes control characters in strings and only
produces valid UTF-8 (the issue measured 12 of 12 valid outputs with it where xgrammar let raw
control characters through). Whitespace is not flexible by default: one space after `,` and
`:` and none elsewhere (`json.dumps`' layout), so a model cannot ramble in runs of spaces or
newlines; a schema may still choose its own through its `x-guidance` options.
"""

from __future__ import annotations

import json

import llguidance

from pagedllm.structured_output.params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = {"type": "object"}

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the problem."""


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar for one (kind, spec) key (see `StructuredOutputsParams.key`)."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            JSON_OBJECT_SCHEMA, defaults=JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # each choice a Lark string literal (JSON string escapes)
        choices = json.loads(spec)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    # Lark, or GBNF translated to Lark
    return llguidance.grammar_from("grammar", spec)


def compile_grammar(
    tokenizer: llguidance.LLTokenizer, kind: str, spec: str
) -> llguidance.LLMatcher:
    """A fresh matcher for (kind, spec): the template each request's matchers are copied
    from. Raises `GrammarError` naming the problem. Releases the GIL while it compiles."""
    try:
        grammar = grammar_text(kind, spec)
    except ValueError as exc:
        raise GrammarError(f"invalid {_KIND_NAMES[kind]}: {exc}") from None
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {_KIND_NAMES[kind]}: {matcher.get_error().strip()}")
    return matcher


def compile_params(
    tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams
) -> llguidance.LLMatcher:
    return compile_grammar(tokenizer, *params.key)
