"""Reasoning through the official `openai` client: `--reasoning-parser qwen3` splits the
thinking into `reasoning`, streamed and not (the thinking forced by a regex under
`enable_in_reasoning`), and `chat_template_kwargs` reach the template."""

from __future__ import annotations

import pytest

from pagedllm.chat.template import render_chat
from pagedllm.chat.tools import ChatOptions

from server_util import live_server

THINKING = r"<think>[a-z]{1,6}</think>[0-9]{1,4}"
# the prompt is 5 bytes longer unless enable_thinking is false (a checkpoint template's switch)
TEMPLATE = (
    "{% if enable_thinking is not defined or enable_thinking %}THINK{% endif %}"
    "{{ messages[-1]['content'] }}"
)


@pytest.fixture(scope="module")
def server():
    options = ChatOptions(reasoning_parser="qwen3", enable_in_reasoning=True)
    with live_server(chat_options=options, chat_template=TEMPLATE) as live:
        yield live


def _request(extra: dict | None = None, **kwargs):
    return dict(
        model="pagedllm/tiny-random",
        messages=[{"role": "user", "content": "think"}],
        max_tokens=40,
        temperature=1.0,
        seed=7,
        extra_body={"structured_outputs": {"regex": THINKING}, **(extra or {})},
        **kwargs,
    )


def test_the_thinking_is_split_from_the_answer(client):
    message = client.chat.completions.create(**_request()).choices[0].message
    assert message.reasoning.isalpha() and message.reasoning_content == message.reasoning
    assert message.content.isdigit()


def test_streamed_thinking_adds_up_to_the_whole_split(client):
    whole = client.chat.completions.create(**_request()).choices[0].message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**_request(stream=True)):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning, whole.content)


def test_chat_template_kwargs_reach_the_template(client):
    on = client.chat.completions.create(**_request()).usage.prompt_tokens
    off = client.chat.completions.create(
        **_request({"chat_template_kwargs": {"enable_thinking": False}})
    )
    assert on - off.usage.prompt_tokens == len("THINK")


def test_render_chat_passes_tools_and_kwargs_to_a_checkpoint_template():
    template = "{{ tools | length }} {{ flavour }}"
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = render_chat(
        [{"role": "user", "content": "x"}],
        chat_template=template,
        tools=tools,
        chat_template_kwargs={"flavour": "dry"},
    )
    assert text == "1 dry"


def test_without_the_flag_a_constraint_waits_for_the_thinking():
    # default placement: the regex constrains the answer only; the thinking is free text
    with live_server(chat_options=ChatOptions(reasoning_parser="deepseek_r1")) as live:
        from openai import OpenAI

        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        response = client.chat.completions.create(
            model="pagedllm/tiny-random",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            extra_body={"structured_outputs": {"regex": "[0-9]+"}},
        )
    message = response.choices[0].message
    # three free tokens of thinking, no `</think>` yet: all of it is reasoning
    assert response.choices[0].finish_reason == "length"
    assert message.content is None and message.reasoning is not None
