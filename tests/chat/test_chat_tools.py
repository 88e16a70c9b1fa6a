"""Planning a chat request's tools and reasoning: which grammar constrains the reply (checked
on llguidance matchers over the byte tokenizer, no model needed) and which requests are
refused, naming the field."""

from __future__ import annotations

import pytest

from pagedllm.chat.tools import ChatOptions, ChatRequestError, plan_chat
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.compiler import compile_params
from pagedllm.structured_output.vocab import ll_tokenizer
from pagedllm.tokenizer import ByteTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
]
AUTO = ChatOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)


def _accepts(constraint: StructuredOutputsParams, text: str) -> bool:
    tokenizer = ByteTokenizer()
    matcher = compile_params(ll_tokenizer(tokenizer, 259, [257]), constraint)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)[1:])


def test_auto_lets_the_model_write_freely():
    plan = plan_chat(AUTO, tools=TOOLS, tool_choice="auto")
    assert _accepts(plan.constraint, "I can answer that without a tool.")


def test_auto_holds_an_opened_call_to_the_tools_schema():
    constraint = plan_chat(AUTO, tools=TOOLS, tool_choice="auto").constraint
    assert _accepts(
        constraint, 'ok <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert not _accepts(constraint, "ok <tool_call>\nnot json")
    assert not _accepts(constraint, '<tool_call>\n{"name": "sub"')
    assert not _accepts(constraint, '<tool_call>\n{"name": "add", "arguments": {"a": "x"')


def test_auto_without_parallel_calls_allows_one_call():
    constraint = plan_chat(AUTO, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert _accepts(constraint.constraint, call)
    assert not _accepts(constraint.constraint, call + "<tool_call>\n{")


def test_required_is_an_array_of_calls_of_the_tools():
    constraint = plan_chat(ChatOptions(), tools=TOOLS, tool_choice="required").constraint
    assert _accepts(constraint, '[{"name": "add", "parameters": {"a": 3}}]')
    assert not _accepts(constraint, "[]")
    assert not _accepts(constraint, '[{"name": "mul"')


def test_a_named_choice_is_that_tools_arguments():
    choice = {"type": "function", "function": {"name": "add"}}
    constraint = plan_chat(ChatOptions(), tools=TOOLS, tool_choice=choice).constraint
    assert _accepts(constraint, '{"a": 3}')
    assert not _accepts(constraint, '{"b"')


def test_tools_default_to_auto_which_needs_a_tool_parser():
    with pytest.raises(ChatRequestError, match="--enable-auto-tool-choice") as info:
        plan_chat(ChatOptions(), tools=TOOLS, tool_choice=None)
    assert info.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        (dict(tools=None, tool_choice="required"), "tool_choice", "needs tools"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
            "not among the tools",
        ),
        (
            dict(
                tools=TOOLS, tool_choice="required", constraint=StructuredOutputsParams(regex="a")
            ),
            "tool_choice",
            "cannot be combined",
        ),
        (dict(tools=TOOLS + TOOLS, tool_choice="none"), "tools[1]", "a second tool"),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
                tool_choice="none",
            ),
            "tools[0].function.parameters",
            "tools\\[0\\].function.parameters",
        ),
    ],
)
def test_a_request_that_cannot_be_served_names_its_field(kwargs, param, message):
    with pytest.raises(ChatRequestError, match=message) as info:
        plan_chat(AUTO, **kwargs)
    assert info.value.param == param


def test_tool_choice_none_renders_the_tools_unless_excluded():
    assert plan_chat(ChatOptions(), tools=TOOLS, tool_choice="none").tools == TOOLS
    excluded = ChatOptions(exclude_tools_when_tool_choice_none=True)
    assert plan_chat(excluded, tools=TOOLS, tool_choice="none").tools is None


def test_a_constraint_applies_after_the_thinking_by_default():
    options = ChatOptions(reasoning_parser="qwen3")
    constraint = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    wrapped = plan_chat(options, tools=None, tool_choice=None, constraint=constraint).constraint
    assert _accepts(wrapped, '<think>any {thinking</think>\n\n{"a": 1}')
    assert _accepts(wrapped, '{"a": 1}')  # no thinking at all
    assert not _accepts(wrapped, "<think>hm</think>not json")


def test_deepseek_r1_thinks_before_the_constraint_without_an_opening_tag():
    options = ChatOptions(reasoning_parser="deepseek_r1")
    wrapped = plan_chat(
        options,
        tools=None,
        tool_choice=None,
        constraint=StructuredOutputsParams(choice=["yes", "no"]),
    ).constraint
    assert _accepts(wrapped, "let me see</think>yes")
    assert not _accepts(wrapped, "let me see</think>maybe")


def test_enable_in_reasoning_constrains_from_the_first_token():
    options = ChatOptions(reasoning_parser="qwen3", enable_in_reasoning=True)
    constraint = StructuredOutputsParams(regex="<think>[a-z]+</think>[0-9]+")
    plan = plan_chat(options, tools=None, tool_choice=None, constraint=constraint)
    assert plan.constraint is constraint


def test_a_grammar_cannot_follow_the_thinking():
    options = ChatOptions(reasoning_parser="qwen3")
    with pytest.raises(ChatRequestError, match="enable_in_reasoning") as info:
        plan_chat(
            options,
            tools=None,
            tool_choice=None,
            constraint=StructuredOutputsParams(grammar="start: /a/"),
        )
    assert info.value.param == "structured_outputs"


def test_auto_tool_calls_follow_the_thinking():
    options = ChatOptions(
        tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3"
    )
    plan = plan_chat(options, tools=TOOLS, tool_choice="auto")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    text = f"<think>which tool?</think>\n\n{call}"
    assert _accepts(plan.constraint, text)
    message = plan.message(text)
    assert message.reasoning == "which tool?"
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("add", '{"a": 2}')]


@pytest.mark.parametrize(
    "options",
    [
        dict(tool_call_parser="nope"),
        dict(reasoning_parser="nope"),
        dict(enable_auto_tool_choice=True),
    ],
)
def test_bad_server_options_are_refused(options):
    with pytest.raises(ValueError):
        ChatOptions(**options)
