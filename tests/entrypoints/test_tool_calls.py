"""Tool calling through the official `openai` client against a live server (hermes parser, auto
tool choice on): two-turn conversations (call -> tool result -> answer) with "required", named
and "auto" choices, streamed and not, and arguments that always parse and validate."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from pagedllm.chat.tools import ChatOptions

from server_util import live_server

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
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
]
SCHEMAS = {"add": ADD, "weather": CITY}
# "auto": a random-weight model never opens a call by itself; the test's own constraint (which
# replaces the tool grammar) makes it write one in the hermes format
FORCED_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]\}\}\n</tool_call>'
CHOICES = {
    "required": ("required", {}),
    "named": ({"type": "function", "function": {"name": "add"}}, {}),
    "auto": ("auto", {"structured_outputs": {"regex": FORCED_CALL}}),
}


@pytest.fixture(scope="module")
def server():
    options = ChatOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)
    engine = dict(max_model_len=1024, num_gpu_blocks=512, max_num_seqs=64)
    with live_server(engine, chat_options=options) as live:
        yield live


def _ask(client, messages, choice: str, stream: bool, extra: dict | None = None):
    tool_choice, forced = CHOICES[choice]
    request = dict(
        model="pagedllm/tiny-random",
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        extra_body=forced if extra is None else extra,
    )
    if not stream:
        return client.chat.completions.create(**request)
    with client.chat.completions.stream(**request) as events:
        for _ in events:
            pass
        return events.get_final_completion()


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_a_two_turn_tool_conversation(client, choice, stream):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    first = _ask(client, messages, choice, stream).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    _check_call(call)
    assert call.function.name == "add"
    # the assistant's message goes back as the client returned it, then the tool's result
    messages += [first.message, {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    answer = _ask(client, messages, "auto", stream, {"structured_outputs": {"regex": "[a-z]{1,6}"}})
    answer = answer.choices[0]
    assert answer.finish_reason == "stop"
    assert answer.message.tool_calls in (None, [])
    assert answer.message.content.isalpha()


def test_the_tool_result_turn_is_rendered_into_the_prompt(client):
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ],
        },
    ]
    short = client.chat.completions.create(
        model="pagedllm/tiny-random",
        messages=messages,
        max_tokens=1,
        tools=TOOLS,
        tool_choice="none",
    )
    longer = client.chat.completions.create(
        model="pagedllm/tiny-random",
        messages=messages + [{"role": "tool", "tool_call_id": "call_1", "content": "2"}],
        max_tokens=1,
        tools=TOOLS,
        tool_choice="none",
    )
    # the byte tokenizer: one token per byte of "<|tool|> call_1\n2\n"
    assert longer.usage.prompt_tokens - short.usage.prompt_tokens == len("<|tool|> call_1\n2\n")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_arguments_always_parse_and_validate(client, choice):
    tool_choice, _ = CHOICES[choice]
    response = client.chat.completions.create(
        model="pagedllm/tiny-random",
        messages=[{"role": "user", "content": "go"}],
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=1234,
        n=50,
        max_tokens=120,
    )
    assert len(response.choices) == 50
    for choice_ in response.choices:
        assert choice_.finish_reason == "tool_calls", choice_.message
        (call,) = choice_.message.tool_calls
        _check_call(call)


def test_streamed_calls_send_the_name_once_then_argument_pieces(server):
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "max_tokens": 40,
        "stream": True,
    }
    pieces = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces += json.loads(line[6:])["choices"]
    calls = [d for p in pieces for d in p["delta"].get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "add" and calls[0]["id"].startswith("call_")
    assert all("name" not in d["function"] and "id" not in d for d in calls[1:])
    json.loads("".join(d["function"]["arguments"] for d in calls))
    assert pieces[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
def test_a_bad_tool_request_is_a_400_naming_the_field(server, body, param):
    request = {"messages": [{"role": "user", "content": "go"}], "tools": TOOLS, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_auto_needs_the_server_flags():
    with live_server() as plain:
        response = httpx.post(
            f"{plain.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "go"}], "tools": TOOLS},
            timeout=30,
        )
    assert response.status_code == 400
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]


# "required": a random model keeps adding calls to the array; at temperature 0 its first call
# closes within 42 tokens and its second after 60, so 60 tokens cut the array mid-second-call
CUT_IN_SECOND_CALL = 60
# the named "weather" tool's arguments ({"city": ..., "unit": ...}) close after 30 tokens
WEATHER = {"type": "function", "function": {"name": "weather"}}
CUT_IN_ARGUMENTS = 20


def _cut_request(tool_choice, max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": "go"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": True,
    }


def _stream_choices(server, body: dict) -> list[dict]:
    """The streamed chunks' choices, in order."""
    choices = []
    url = f"{server.url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices += json.loads(line[6:])["choices"]
    return choices


def _reply_text(logprobs: list[dict]) -> str:
    """The raw reply, from its tokens' logprobs (the byte tokenizer: one token per byte)."""
    return "".join(token["token"] for token in logprobs)


def test_a_required_array_cut_by_max_tokens_keeps_its_whole_calls_and_the_cut_ones_text(server):
    body = _cut_request("required", CUT_IN_SECOND_CALL)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    (choice,) = response.json()["choices"]
    reply = _reply_text(choice["logprobs"]["content"])
    # the cut landed inside the second call
    assert reply.count('{"name"') == 2
    assert choice["finish_reason"] == "length"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)
    cut = choice["message"]["content"]  # the second call's text, not dropped
    assert cut.startswith('{"name"') and reply.endswith(cut)


def test_a_streamed_required_array_cut_by_max_tokens_sends_the_cut_call_as_text_last(server):
    body = _cut_request("required", CUT_IN_SECOND_CALL)
    choices = _stream_choices(server, body)
    reply = _reply_text([t for c in choices for t in (c["logprobs"] or {}).get("content", ())])
    assert reply.count('{"name"') == 2
    calls = [d for c in choices for d in c["delta"].get("tool_calls") or ()]
    # the completed call in one delta (id, name, all its arguments); the cut one never a call
    (call,) = calls
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD)
    content = [c["delta"]["content"] for c in choices[1:] if "content" in c["delta"]]
    assert "content" in choices[-1]["delta"] and choices[-1]["finish_reason"] == "length"
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    message = whole["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == call["function"]
    assert "".join(content) == message["content"]


def test_a_named_call_cut_by_max_tokens_is_its_text_with_finish_reason_length(server):
    body = _cut_request(WEATHER, CUT_IN_ARGUMENTS)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    (choice,) = response.json()["choices"]
    reply = _reply_text(choice["logprobs"]["content"])
    assert choice["finish_reason"] == "length"
    # what was generated (the logprobs' tokens are bytes: compared where they are ASCII)
    content = choice["message"]["content"]
    assert content.startswith('{"city": "') and reply.startswith('{"city": "')
    assert "tool_calls" not in choice["message"]


def test_a_streamed_named_call_cut_by_max_tokens_sends_its_text_never_its_name(server):
    choices = _stream_choices(server, _cut_request(WEATHER, CUT_IN_ARGUMENTS))
    reply = _reply_text([t for c in choices for t in (c["logprobs"] or {}).get("content", ())])
    assert all("tool_calls" not in c["delta"] for c in choices)
    content = [c["delta"]["content"] for c in choices[1:] if "content" in c["delta"]]
    assert choices[-1]["finish_reason"] == "length"
    whole = httpx.post(
        f"{server.url}/v1/chat/completions",
        json=_cut_request(WEATHER, CUT_IN_ARGUMENTS),
        timeout=60,
    )
    assert "".join(content) == whole.json()["choices"][0]["message"]["content"]
    assert reply.startswith('{"city": "')
