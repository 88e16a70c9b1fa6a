"""A JSON schema nested deeper than the grammar engine takes is a ValueError at construction
(offline and over HTTP alike), never a RecursionError from whatever walks it first."""

from __future__ import annotations

import json

import llguidance
import pytest

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.compiler import JSON_OPTIONS
from pagedllm.structured_output.params import MAX_JSON_DEPTH


def _nested(levels: int) -> dict:
    """`levels` nested objects and arrays in all: {"const": [[...]]}."""
    value: list = []
    for _ in range(levels - 2):
        value = [value]
    return {"const": value}


def test_schema_at_the_depth_limit_is_accepted():
    params = StructuredOutputsParams(json=_nested(MAX_JSON_DEPTH))
    assert SamplingParams(structured_outputs=params).structured_outputs is params


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000])
def test_schema_past_the_depth_limit_is_a_value_error(levels):
    with pytest.raises(
        ValueError, match=f"StructuredOutputsParams.json .* {MAX_JSON_DEPTH} levels"
    ):
        StructuredOutputsParams(json=_nested(levels))


def test_schema_string_too_deep_for_json_loads_is_a_value_error():
    text = '{"const": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError, match=f"at most {MAX_JSON_DEPTH} levels"):
        StructuredOutputsParams(json=text)


def test_the_limit_is_the_grammar_engines_own():
    def compiles(levels: int) -> bool:
        try:
            llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(_nested(levels)), defaults=JSON_OPTIONS
            )
        except ValueError:
            return False
        return True

    assert compiles(MAX_JSON_DEPTH)
    assert not compiles(MAX_JSON_DEPTH + 1)
