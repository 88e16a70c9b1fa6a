"""One constraint (`StructuredOutputsParams`) to a compiled llguidance matcher.

JSON settings: llguidance's JSON grammar escapes control characters in strings and only
produces valid UTF-8 (the issue measured 12 of 12 valid outputs with it where xgrammar let raw
control characters through). Whitespace is not flexible by default: one space after `,` and
`:` and none elsewhere (`json.dumps`' layout), so a model cannot ramble in runs of spaces or
newlines; a schema may still choose its own through its `x-guidance` options.

llguidance keeps its own limits (`LIMITS`: at most 2,000 Earley items in a row, bounded lexer
work), which bound the grammar's share of every step. A constraint that compiles but breaks
them, or that no output can satisfy, fails as soon as it is used; `compile_grammar` takes its
first step on copies (`check_first_step`) so it is refused when it compiles, not mid-request
(a grammar that breaks a limit only later still ends its request with a short error).
A choice list is one lexeme (`CHOICE: "a" | "b" | ...`): the lexer takes a list of any length,
where one grammar alternative per choice went past the row limit at about 2,000 choices.
llguidance's errors come without its state and grammar dump and are cut to
`MAX_ERROR_CHARS` (`short_error`) wherever they reach a user or the log.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import llguidance
import numpy as np

from pagedllm.structured_output.params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = {"type": "object"}
# llguidance's default limits; its errors without the parser state and grammar they would dump
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
MAX_ERROR_CHARS = 300

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the problem."""


def short_error(message: str) -> str:
    """An llguidance error message as a user or the log sees it: one paragraph, at most
    `MAX_ERROR_CHARS` characters (a message may quote the whole grammar)."""
    text = " ".join(message.replace("<non-verbose/>", "").split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return text


def grammar_text(kind: str, spec: str) -> str:
    """llguidance's grammar for one (kind, spec) key (see `StructuredOutputsParams.key`)."""
    if kind == "json":
        for pattern in _schema_patterns(json.loads(spec)):
            _check_escapes(pattern, "pattern ")
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            JSON_OBJECT_SCHEMA, defaults=JSON_OPTIONS
        )
    if kind == "regex":
        _check_escapes(spec)
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # one lexeme, each choice a Lark string literal (JSON string escapes)
        choices = json.loads(spec)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)
        )
    # Lark, or GBNF translated to Lark
    return llguidance.grammar_from("grammar", spec)


def _check_escapes(regex: str, what: str = "") -> None:
    # llguidance's regex to Lark drops a trailing lone backslash: `a\` would mean `a`, and a
    # JSON schema's unanchored pattern `\` anything
    if (len(regex) - len(regex.rstrip("\\"))) % 2:
        raise ValueError(f"{what}{regex!r} ends in an unfinished escape (a lone backslash)")


def _schema_patterns(schema) -> Iterator[str]:
    """The regexes of a JSON schema: `pattern` values and `patternProperties` keys. Walked
    without recursion (a schema may nest deeply); instance data (`const`, `enum`, `default`,
    `examples`) is not walked."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                elif key == "patternProperties" and isinstance(value, dict):
                    yield from value
                    stack.extend(value.values())
                elif key not in ("const", "enum", "default", "examples"):
                    stack.append(value)


def compile_grammar(
    tokenizer: llguidance.LLTokenizer, kind: str, spec: str
) -> llguidance.LLMatcher:
    """A fresh matcher for (kind, spec): the template each request's matchers are copied
    from. Raises `GrammarError` naming the problem. Releases the GIL while it compiles."""
    name = _KIND_NAMES[kind]
    try:
        grammar = grammar_text(kind, spec)
    except ValueError as exc:
        raise GrammarError(f"invalid {name}: {short_error(str(exc))}") from None
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise GrammarError(f"invalid {name}: {short_error(matcher.get_error())}")
    check_first_step(matcher, tokenizer, name)
    return matcher


def check_first_step(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, name: str):
    """Raises `GrammarError` if `matcher`'s grammar fails on its first step: its first mask (a
    grammar no output satisfies, e.g. a schema that only refers to itself), or its first token
    (llguidance builds the first rows then, and a grammar past its limits fails there). Each
    allowed single-byte token is tried on a copy: tokens that start with the same byte take
    the parser the same first step, so this covers every first token the tokenizer can spell
    byte by byte."""
    probe = matcher.deep_copy()
    allowed = np.unpackbits(
        np.frombuffer(probe.compute_bitmask(), dtype=np.uint8), bitorder="little"
    )
    if probe.is_error():
        raise GrammarError(
            f"invalid {name}: no output satisfies it ({short_error(probe.get_error())})"
        )
    for token in _byte_tokens(tokenizer):
        if allowed[token] and not (probe := matcher.deep_copy()).consume_token(token):
            raise GrammarError(
                f"{name} too large or complex for the grammar engine "
                f"({short_error(probe.get_error())})"
            )


@functools.lru_cache(maxsize=8)  # one table per engine's tokenizer; a few engines per process
def _byte_tokens(tokenizer: llguidance.LLTokenizer) -> tuple[int, ...]:
    """The token of each byte value the tokenizer has one token for."""
    singles = (tokenizer.tokenize_bytes(bytes([b])) for b in range(256))
    return tuple(ids[0] for ids in singles if len(ids) == 1)


def compile_params(
    tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams
) -> llguidance.LLMatcher:
    return compile_grammar(tokenizer, *params.key)
