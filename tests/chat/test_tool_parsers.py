"""The tool-call parsers on crafted replies: several calls, text around them, malformed JSON
(left as content, never an exception), and streamed deltas that add up to the whole answer."""

from __future__ import annotations

import json

import pytest

from pagedllm.chat.tool_parsers import ToolCallDeltas, get_tool_parser
from pagedllm.chat.tools import NamedCall, RequiredCalls

HERMES_TWO_CALLS = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "}{"}}\n</tool_call>\n'
    "Done."
)


def _stream(parser, text: str, step: int = 1) -> tuple[str, dict[int, dict]]:
    """Feeds `text` in pieces of `step` characters; (content, calls by index) as a client that
    accumulates the deltas sees them. Checks the name comes once, in the first delta."""
    deltas, content, calls = ToolCallDeltas(parser), "", {}
    for end in range(step, len(text) + step, step):
        piece, call_deltas = deltas.update(text[:end], final=end >= len(text))
        content += piece
        for d in call_deltas:
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function"
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


def test_hermes_extracts_several_calls_and_keeps_the_text_around_them():
    content, calls = get_tool_parser("hermes").extract(HERMES_TWO_CALLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("add", {"a": 1, "b": "}{"}),
    ]
    assert calls[0].arguments == '{"city": "Paris", "days": [1, 2]}'  # as the model wrote it
    assert content == "Let me look.\n\n\nDone."
    assert all(c.id.startswith("call_") and len(c.id) == 29 and c.id[5:].isalnum() for c in calls)


def test_hermes_leaves_a_malformed_call_in_the_content():
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> bye'
    content, calls = get_tool_parser("hermes").extract(text)
    assert calls == []
    assert content == text


def test_hermes_keeps_good_calls_next_to_a_malformed_one():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    content, calls = get_tool_parser("hermes").extract(text)
    assert [c.name for c in calls] == ["f"] and calls[0].arguments == "{}"
    assert content == "<tool_call>{oops}</tool_call>"


def test_hermes_without_calls_is_all_content():
    assert get_tool_parser("hermes").extract("just text") == ("just text", [])


def test_hermes_takes_a_call_whose_closing_tag_is_missing():
    content, calls = get_tool_parser("hermes").extract(
        '<tool_call>\n{"name": "f", "arguments": {"x": 2}}'
    )
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 2}')]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_hermes_streamed_deltas_add_up_to_the_extracted_calls(step):
    parser = get_tool_parser("hermes")
    content, calls = _stream(parser, HERMES_TWO_CALLS, step)
    whole_content, whole_calls = parser.extract(HERMES_TWO_CALLS)
    assert content == whole_content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.name, c.arguments) for c in whole_calls
    ]


def test_hermes_stream_holds_back_a_tag_that_may_be_starting():
    deltas = ToolCallDeltas(get_tool_parser("hermes"))
    assert deltas.update("Hi <tool_", final=False) == ("Hi ", [])
    assert deltas.update("Hi <tool_x", final=False) == ("<tool_x", [])


def test_hermes_streams_arguments_in_pieces_after_the_name():
    deltas = ToolCallDeltas(get_tool_parser("hermes"))
    _, first = deltas.update('<tool_call>\n{"name": "f", "arguments": {"a": 1', final=False)
    assert first[0]["function"] == {"name": "f", "arguments": '{"a": 1'}
    _, later = deltas.update('<tool_call>\n{"name": "f", "arguments": {"a": 12}}', final=False)
    assert later == [{"index": 0, "function": {"arguments": "2}"}}]


def test_llama3_json_extracts_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    content, calls = get_tool_parser("llama3_json").extract(text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]


def test_llama3_json_takes_a_bare_json_call_and_text_before_the_tag():
    parser = get_tool_parser("llama3_json")
    _, calls = parser.extract(' {"name": "a", "parameters": {"x": [1]}}')
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": [1]}')]
    content, calls = parser.extract('Sure. <|python_tag|>{"name": "a", "parameters": {}}')
    assert content == "Sure. " and [c.name for c in calls] == ["a"]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "a", "parameters": {"x": 1}',  # cut short
        '{"name": "a", "parameters": {"x": 1}} and more text',
        '{"parameters": {}}',  # no name
        '{"name": "a", "parameters": {}}; {"name": ',
    ],
)
def test_llama3_json_leaves_anything_but_whole_calls_as_content(text):
    assert get_tool_parser("llama3_json").extract(text) == (text, [])


@pytest.mark.parametrize("step", [1, 5])
def test_llama3_json_streamed_deltas_add_up_to_the_extracted_calls(step):
    text = (
        '<|python_tag|>{"name": "a", "parameters": {"s": "x;y}"}}; '
        '{"name": "b", "parameters": {"n": 3}}'
    )
    parser = get_tool_parser("llama3_json")
    content, calls = _stream(parser, text, step)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.name, c.arguments) for c in parser.extract(text)[1]
    ]


def test_llama3_json_streams_plain_text_as_content():
    content, calls = _stream(get_tool_parser("llama3_json"), "Hello there", 2)
    assert (content, calls) == ("Hello there", {})


def test_required_calls_are_read_from_the_json_array():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    content, calls = RequiredCalls().extract(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    assert _stream(RequiredCalls(), text, 4)[1] == {
        0: {"name": "a", "arguments": '{"x": 1}'},
        1: {"name": "b", "arguments": "{}"},
    }


def test_a_required_reply_cut_short_keeps_the_whole_calls_and_the_cut_ones_text():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"x": 1'
    content, calls = RequiredCalls().extract(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')]
    assert content == '{"name": "b", "parameters": {"x": 1'


def test_a_required_reply_cut_in_its_first_call_is_its_text():
    text = '[{"name": "a", "parameters": {"x": 1'
    assert RequiredCalls().extract(text) == (text, [])
    assert _stream(RequiredCalls(), text) == (text, {})


def test_a_required_reply_cut_right_after_a_call_has_no_content():
    text = '[{"name": "a", "parameters": {"x": 1}}, '
    content, calls = RequiredCalls().extract(text)
    assert content is None and [c.name for c in calls] == ["a"]


@pytest.mark.parametrize("step", [1, 4])
def test_a_required_call_is_streamed_whole_once_its_object_closes(step):
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"x": 1'
    for end in range(1, len(text) + 1):  # nothing of "b" is ever sent as a call
        assert [c.name for c in RequiredCalls().partial(text[:end], final=False)[1]] in (
            [],
            ["a"],
        )
    # the cut call's text comes as content at the end, as the whole reply has it
    assert _stream(RequiredCalls(), text, step) == (
        '{"name": "b", "parameters": {"x": 1',
        {0: {"name": "a", "arguments": '{"x": 1}'}},
    )


def test_a_named_call_cut_short_is_its_text_streamed_or_whole():
    text = '{"x": [1, 2'
    assert NamedCall("f").extract(text) == (text, [])
    assert _stream(NamedCall("f"), text) == (text, {})


def test_a_named_call_is_the_whole_reply():
    content, calls = NamedCall("f").extract('{"x": [1, 2]}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": [1, 2]}')]
    assert _stream(NamedCall("f"), '{"x": [1, 2]}', 3)[1] == {
        0: {"name": "f", "arguments": '{"x": [1, 2]}'}
    }


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("text", ["", "<tool_call>", "{", '{"name": 1, "arguments": 2}', "\\", '"'])
def test_parsers_never_raise_on_odd_text(name, text):
    parser = get_tool_parser(name)
    parser.extract(text)
    _stream(parser, text)


def test_an_unknown_parser_names_the_ones_there_are():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")
