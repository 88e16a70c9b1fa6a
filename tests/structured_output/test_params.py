"""`StructuredOutputsParams`: vLLM's names, exactly one constraint, shape checked at
construction; reachable from `pagedllm` and `pagedllm.sampling_params`."""

from __future__ import annotations

import pytest

import pagedllm
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def test_importable_from_the_package_and_sampling_params():
    assert pagedllm.StructuredOutputsParams is StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "integer"}'}, "json"),
        ({"json_object": True}, "json_object"),
        ({"regex": "[a-z]+"}, "regex"),
        ({"choice": ["a", "b"]}, "choice"),
        ({"grammar": 'start: "x"'}, "grammar"),
    ],
)
def test_one_constraint_names_its_kind(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind


def test_no_constraint_is_refused():
    with pytest.raises(ValueError, match="exactly one constraint .*got 0"):
        StructuredOutputsParams()


def test_two_constraints_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"got 2 \(regex, choice\)"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json": "{not json"}, "json"),
        ({"json": 3}, "json"),
        ({"json_object": "yes"}, "json_object"),
        ({"regex": ""}, "regex"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"grammar": "  "}, "grammar"),
    ],
)
def test_malformed_constraints_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"StructuredOutputsParams.{field} "):
        StructuredOutputsParams(**kwargs)


def test_cache_key_keeps_the_schema_property_order():
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"properties": {"b": {}, "a": {}}}')
    assert a.key == b.key
    assert a.key[1].index('"b"') < a.key[1].index('"a"')


def test_sampling_params_takes_only_structured_outputs_params():
    so = StructuredOutputsParams(regex="x")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "x"})


def test_structured_outputs_refuse_min_tokens_naming_it():
    # the constraint decides where the output ends: choice "yes" cannot reach 10 tokens
    so = StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match="SamplingParams.min_tokens must be 0 with structured"):
        SamplingParams(structured_outputs=so, min_tokens=10)
    assert SamplingParams(structured_outputs=so, min_tokens=0).min_tokens == 0
