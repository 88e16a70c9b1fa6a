"""What the JSON grammar lets a model write, read off the bitmask on the byte vocabulary (where
every byte is a token): inside a string no raw control character and no byte that breaks UTF-8,
escapes allowed; between tokens no free whitespace."""

from __future__ import annotations

import pytest
from so_constraints import SCHEMA

from pagedllm import StructuredOutputsParams
from pagedllm.sampling.grammar_mask import allowed_tokens


@pytest.fixture(scope="module")
def allowed_after(llm):
    manager = llm.engine.structured_output
    template = manager.compile(StructuredOutputsParams(json=SCHEMA)).result()

    def allowed(prefix: bytes) -> set[int]:
        matcher = template.deep_copy()
        assert matcher.consume_tokens(list(prefix)), matcher.get_error()
        bits = manager.fill_now([matcher])
        return set(allowed_tokens(bits, 259)[0].nonzero().flatten().tolist())

    return allowed


def test_strings_admit_no_raw_control_character_but_escapes(allowed_after):
    inside = allowed_after(b'{"done": true, "color": "red", "name": "a')
    assert not inside & set(range(0x20)), "raw control characters"
    assert {ord("\\"), ord('"'), ord("a")} <= inside
    escape = allowed_after(b'{"done": true, "color": "red", "name": "a\\')
    assert {ord(c) for c in 'ntu"\\'} <= escape
    assert ord("x") not in escape


def test_strings_stay_valid_utf8(allowed_after):
    inside = allowed_after(b'{"done": true, "color": "red", "name": "a')
    assert not inside & ({0xC0, 0xC1} | set(range(0xF5, 0x100))), "never-valid lead bytes"
    assert not inside & set(range(0x80, 0xC0)), "a continuation byte without a lead byte"
    after_lead = allowed_after(b'{"done": true, "color": "red", "name": "\xe2')
    assert after_lead and after_lead <= set(range(0x80, 0xC0)), "only continuation bytes"


def test_whitespace_is_fixed(allowed_after):
    assert allowed_after(b"{") == {ord('"')}
    assert allowed_after(b'{"done"') == {ord(":")}
    assert allowed_after(b'{"done":') == {ord(" ")}
    assert allowed_after(b'{"done": true') == {ord(",")}
