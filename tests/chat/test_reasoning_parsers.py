"""The reasoning parsers: `<think>` thinking split from the answer, whole and streamed."""

from __future__ import annotations

import pytest

from pagedllm.chat.reasoning_parsers import get_reasoning_parser


@pytest.mark.parametrize(
    ("name", "text", "split"),
    [
        ("qwen3", "<think>\nhm\n</think>\n\nHello", ("\nhm\n", "\n\nHello")),
        ("qwen3", "Hello", (None, "Hello")),  # thinking switched off
        ("qwen3", "<think>cut off", ("cut off", "")),
        ("deepseek_r1", "hm</think>Hello", ("hm", "Hello")),  # <think> was in the prompt
        ("deepseek_r1", "<think>hm</think>Hello", ("hm", "Hello")),
        ("deepseek_r1", "still thinking", ("still thinking", "")),
    ],
)
def test_a_reply_splits_into_thinking_and_answer(name, text, split):
    assert get_reasoning_parser(name).split(text) == split


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>a</think>b", "<think>a </thin", "x</think>y", "plain"])
def test_streamed_pieces_add_up_to_the_split(name, text):
    parser = get_reasoning_parser(name)
    thinking, answer = "", ""
    for end in range(1, len(text) + 1):
        t, a = parser.partial(text[:end], final=end == len(text))
        assert t.startswith(thinking) and a.startswith(answer)  # only ever grows
        thinking, answer = t, a
    whole_thinking, whole_answer = parser.split(text)
    assert (thinking, answer) == (whole_thinking or "", whole_answer)


def test_a_tag_that_may_be_starting_is_held_back():
    parser = get_reasoning_parser("qwen3")
    assert parser.partial("<thi", final=False) == ("", "")
    assert parser.partial("<think>abc</th", final=False) == ("abc", "")
