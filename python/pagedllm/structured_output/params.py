"""`StructuredOutputsParams`: the constraint one request samples under (vLLM's names).

Pure Python on purpose (it is part of `SamplingParams`, which must import without torch or the
grammar engine): the constraint is checked for shape here; whether a schema, regex or grammar
is *valid* is the grammar engine's to say when it compiles it (`pagedllm.structured_output`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint kinds, in the order they are named in errors.
KINDS = ("json", "json_object", "regex", "choice", "grammar")

# How deeply objects and arrays may nest in a JSON schema: the grammar engine (llguidance, via
# serde_json) refuses deeper ones anyway. Checked here, before anything recurses over the
# schema: Python's json.dumps of the cache key overflows its stack at ~490 levels.
MAX_JSON_DEPTH = 127
_TOO_DEEP = (
    f"StructuredOutputsParams.json must nest objects and arrays at most {MAX_JSON_DEPTH} levels"
)


def _fail(name: str, value: Any, rule: str) -> None:
    raise ValueError(f"StructuredOutputsParams.{name} {rule}, got {value!r}")


def _too_deep(value: Any) -> bool:
    """Whether dicts and lists nest more than MAX_JSON_DEPTH levels in `value` (iteratively, so
    any depth is measured)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, (list, tuple)):
            continue
        if depth > MAX_JSON_DEPTH:
            return True
        stack.extend((v, depth + 1) for v in item)
    return False


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint for a request's output:

    - `json`: a JSON schema (a dict, or a str holding one): the output is a JSON value valid
      against it (whitespace between tokens limited to one space after `,` and `:`);
    - `json_object=True`: any JSON object;
    - `regex`: the whole output matches this regular expression (Rust `regex` syntax);
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a context-free grammar, in Lark syntax (llguidance's dialect) or GBNF.

    Once the constraint is complete only EOS may follow, so the request finishes with `stop`.
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and self._is_set(k)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one constraint of "
                f"{', '.join(KINDS)}; got {len(given)}"
                + (f" ({', '.join(given)})" if given else "")
            )
        getattr(self, f"_check_{given[0]}")()

    def _is_set(self, kind: str) -> bool:
        # json_object=False says "no constraint", as in vLLM
        return kind != "json_object" or self.json_object is not False

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                _fail("json", self.json, f"must be a JSON schema; the str is not JSON ({exc})")
            except RecursionError:
                raise ValueError(_TOO_DEEP) from None
        if not isinstance(schema, (dict, bool)):
            _fail("json", self.json, "must be a JSON schema (a dict, or a str holding one)")
        if _too_deep(schema):
            raise ValueError(_TOO_DEEP)

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            _fail("json_object", self.json_object, "must be True (or None)")

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            _fail("regex", self.regex, "must be a non-empty str")

    def _check_choice(self) -> None:
        choice = self.choice
        if (
            not isinstance(choice, (list, tuple))
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            _fail("choice", choice, "must be a non-empty list of non-empty str")
        self.choice = list(choice)

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            _fail("grammar", self.grammar, "must be a non-empty str (Lark or GBNF)")

    @property
    def kind(self) -> str:
        """The constraint's kind: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) is not None and self._is_set(k))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as a canonical str): what a compiled grammar is cached by."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, getattr(self, kind)
