"""`POST /v1/responses` without a server: input items as chat messages, a reply split into
output items (reasoning from the reasoning parser), a streamed reply's events from cumulative
outputs, and malformed bodies named to the field."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedllm.chat.tools import ChatOptions, Message, plan_chat
from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.responses_output import output_items, split_reply
from pagedllm.entrypoints.responses_protocol import chat_messages, parse_request
from pagedllm.entrypoints.responses_stream import _events
from pagedllm.outputs import ToolCall

THINKING = ChatOptions(reasoning_parser="qwen3")


def test_instructions_come_first_and_developer_is_a_system_message():
    body = parse_request(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use French."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}],
                },
            ],
        }
    )
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use French."},
        {"role": "user", "content": "a"},
    ]


def test_calls_join_the_assistant_message_and_reasoning_reaches_it():
    call = {"type": "function_call", "name": "add", "arguments": '{"a": 1}'}
    body = parse_request(
        {
            "input": [
                {"role": "user", "content": "sum"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "hm"}],
                },
                {**call, "call_id": "c1"},
                {**call, "call_id": "c2"},
                {"type": "function_call_output", "call_id": "c2", "output": "1"},
            ]
        }
    )
    user, assistant, tool = chat_messages(body)
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert assistant["reasoning"] == "hm" and assistant["content"] is None
    assert tool == {"role": "tool", "tool_call_id": "c2", "content": "1"}


def test_a_schema_field_is_named_as_the_client_spells_it():
    with pytest.raises(APIError) as error:
        parse_request({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}})
    assert error.value.param == "text.format.schema"


def test_a_reply_with_thinking_is_a_reasoning_item_then_a_message():
    plan = plan_chat(THINKING, tools=None, tool_choice=None)
    reasoning, message = output_items(split_reply(plan, "<think>hm</think>42"), "completed")
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "hm"
    assert message["content"][0]["text"] == "42" and message["status"] == "completed"


def test_a_cut_reply_leaves_its_whole_calls_completed():
    split = Message(None, None, [ToolCall("add", '{"a": 1}')])
    [call] = output_items(split, "incomplete")
    assert call["type"] == "function_call" and call["status"] == "completed"
    [message] = output_items(Message(None, "4", []), "incomplete")
    assert message["status"] == "incomplete"


def _fake_job(texts: list[str], finish_reason: str):
    """A job whose cumulative outputs are `texts`, one token each, the last one finished."""

    async def outputs():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            completion = SimpleNamespace(
                index=0,
                text=text,
                token_ids=list(range(i + 1)),
                logprobs=None,
                finish_reason=finish_reason if last else None,
            )
            yield 0, SimpleNamespace(outputs=[completion], finished=last)

    return SimpleNamespace(outputs=outputs, num_prompt_tokens=3, num_cached_tokens=0)


def _stream(texts: list[str], finish_reason: str = "stop", plan=None) -> list[dict]:
    plan = plan or plan_chat(THINKING, tools=None, tool_choice=None)
    server = SimpleNamespace(engine=SimpleNamespace(tokenizer=None))
    head = {"id": "resp_1", "status": "in_progress", "output": []}

    async def collect():
        return [e async for e in _events(server, _fake_job(texts, finish_reason), plan, head)]

    return asyncio.run(collect())


def test_a_streamed_reply_with_thinking_streams_its_reasoning_item_first():
    events = _stream(["<think>h", "<think>hm</think>", "<think>hm</think>4", "<think>hm</think>42"])
    kinds = [(e["type"], e.get("output_index")) for e in events]
    assert kinds == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "42"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_streamed_reply_cut_by_its_limit_ends_incomplete():
    events = _stream(["a", "ab"], finish_reason="length")
    assert events[-1]["type"] == "response.incomplete"
    response = events[-1]["response"]
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][-1]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 2


ADD_TOOL = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CUT_SECOND = '[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "parameters": {"a'


def test_a_required_call_cut_in_its_first_call_is_an_incomplete_message_of_its_text():
    plan = plan_chat(ChatOptions(), tools=ADD_TOOL, tool_choice="required")
    text = '[{"name": "add", "parameters": {"a'
    [message] = output_items(split_reply(plan, text), "incomplete")
    assert message["type"] == "message" and message["status"] == "incomplete"
    assert message["content"][0]["text"] == text


def test_a_required_array_cut_in_its_second_call_is_the_call_then_the_cut_text():
    plan = plan_chat(ChatOptions(), tools=ADD_TOOL, tool_choice="required")
    call, message = output_items(split_reply(plan, CUT_SECOND), "incomplete")
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert message["status"] == "incomplete"
    assert message["content"][0]["text"] == '{"name": "add", "parameters": {"a'


def test_a_streamed_cut_required_array_ends_with_the_items_of_the_whole_reply():
    plan = plan_chat(ChatOptions(), tools=ADD_TOOL, tool_choice="required")
    texts = [CUT_SECOND[:end] for end in range(4, len(CUT_SECOND) + 4, 4)]
    events = _stream(texts, "length", plan)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    whole = output_items(split_reply(plan, CUT_SECOND), "incomplete")
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole]
    assert [
        {k: v for k, v in i.items() if k not in ("id", "call_id")} for i in final["output"]
    ] == (strip)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == '{"name": "add", "parameters": {"a'
