"""`POST /v1/responses` through the official `openai` client against a live server (hermes
parser, auto tool choice on): text in and out with usage, a function-call round trip, a JSON
schema `text.format` that parses, streamed events in OpenAI's order, a cut reply that is
incomplete (a cut forced call: its text in an incomplete message), and bad input answered with
a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from pagedllm.chat.tools import ChatOptions

from server_util import MODEL, live_server

ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 4}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "add", "parameters": ADD}]
# no reply under it fits in a few tokens: a cut one for sure
LONG = {"type": "string", "minLength": 60, "maxLength": 60, "pattern": "^[a-z]+$"}


@pytest.fixture(scope="module")
def server():
    options = ChatOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)
    engine = dict(max_model_len=1024, num_gpu_blocks=256)
    with live_server(engine, chat_options=options) as live:
        yield live


def _create(client, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def _json_format(schema: dict) -> dict:
    return {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}


def test_text_in_text_out_with_usage(client):
    response = _create(client, input="Hello there", max_output_tokens=8)
    assert response.object == "response" and response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_instructions_lengthen_the_prompt(client):
    plain = _create(client, input="Hi", max_output_tokens=1)
    instructed = _create(client, input="Hi", instructions="Be brief.", max_output_tokens=1)
    assert instructed.usage.input_tokens > plain.usage.input_tokens
    assert instructed.instructions == "Be brief."


def test_a_required_call_round_trip(client):
    question = {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]}
    first = _create(
        client,
        input=[question],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "4"}
    second = _create(
        client, input=[question, call.model_dump(), answer], tools=TOOLS, max_output_tokens=4
    )
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_json_schema_text_format_parses(client):
    response = _create(client, input="Weather?", text=_json_format(CITY), max_output_tokens=60)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text.format.type == "json_schema"


def test_a_cut_reply_is_incomplete(client):
    response = _create(client, input="x", text=_json_format(LONG), max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens == 3


def _stream(client, **kwargs) -> list:
    return list(_create(client, stream=True, **kwargs))


def test_streamed_text_events_come_in_order(client):
    events = _stream(client, input="Hello", max_output_tokens=8)
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = types[4:-4]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    assert events[2].item.id == final.output[0].id and final.usage.output_tokens <= 8


def test_streamed_call_arguments_add_up_to_the_call(client):
    events = _stream(
        client,
        input="What is 2 + 2?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    [call] = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), ADD)


def test_a_cut_stream_ends_incomplete(client):
    events = _stream(client, input="x", text=_json_format(LONG), max_output_tokens=3)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


# a required call's JSON (`[{"name": "add", "parameters": {"a": N}}]`) is longer than this
CUT_IN_FIRST_CALL = 12


def test_a_required_call_cut_in_its_first_call_is_its_text_in_an_incomplete_message(client):
    response = _create(
        client, input="x", tools=TOOLS, tool_choice="required", max_output_tokens=CUT_IN_FIRST_CALL
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output  # never an empty message: the generated text, not a call
    assert message.type == "message" and message.status == "incomplete"
    assert (
        message.content[0].text.startswith("[")
        and response.usage.output_tokens == CUT_IN_FIRST_CALL
    )


def test_a_streamed_required_call_cut_in_its_first_call_streams_its_text(client):
    events = _stream(
        client, input="x", tools=TOOLS, tool_choice="required", max_output_tokens=CUT_IN_FIRST_CALL
    )
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert not [e for e in events if e.type.startswith("response.function_call")]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [message] = final.output
    assert message.status == "incomplete" and message.content[0].text == deltas
    whole = _create(
        client, input="x", tools=TOOLS, tool_choice="required", max_output_tokens=CUT_IN_FIRST_CALL
    )
    assert whole.output[0].content[0].text == deltas


def _post(server, **body) -> httpx.Response:
    # json.dumps writes a lone surrogate as its escape: valid JSON, not Unicode
    content = json.dumps({"model": MODEL, **body})
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}/v1/responses", content=content, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "4"}]},
            "input[0].call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
        ),
        ({"input": "word " * 1200}, "input"),
        ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens"),
        ({"input": "x", "text": _json_format({"$ref": "#"})}, "text.format"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "mul"}}, None),
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "frequency": 1}, "frequency"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [5]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "\udc00"}]}]},
            "input[0].content[0].text",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    response = _post(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == (param or "tool_choice"), error


def test_a_stream_the_client_leaves_is_aborted(server):
    aborted_before = server.engine.engine.get_stats()["num_aborted"]
    body = {"model": MODEL, "input": "x", "stream": True, "max_output_tokens": 900}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: response.created"
    server.wait_idle()
    assert server.engine.engine.get_stats()["num_aborted"] == aborted_before + 1
