"""Reasoning parsers (`--reasoning-parser NAME`): split a reply's `<think>...</think>` thinking
from its answer, whole or streamed, and give the grammar prefix that lets the model think freely
before a constraint applies to the answer.

- `qwen3`: a reply that starts with `<think>` thinks until `</think>` (or to its end, if cut
  off); any other reply is all answer (the thinking was switched off, e.g. with
  `chat_template_kwargs={"enable_thinking": false}`).
- `deepseek_r1`: the reply thinks until `</think>` whether or not it starts with `<think>` (the
  template may have written the opening tag into the prompt); without `</think>` it is all
  thinking.

`partial(text, final)` gives (thinking, answer) as far as they are certain: a suffix that may be
the start of a tag is held back until it is known, so both only grow as the text grows.
"""

from __future__ import annotations

from typing import ClassVar

from pagedllm.chat.tool_parsers.base import held_back

START, END = "<think>", "</think>"
# the thinking ends at the first `</think>` (lazy); the whitespace after it is no answer's
_THINK_RULES = (
    f'think_body[lazy]: THINK_TEXT "{END}"\nTHINK_TEXT: /(.|\\n)*/\nTHINK_WS: /[ \\t\\r\\n]*/\n'
)


class ReasoningParser:
    name: ClassVar[str]
    # whether a reply that does not start with <think> is thinking all the same
    thinks_without_start: ClassVar[bool]

    def partial(self, text: str, final: bool) -> tuple[str, str]:
        """(thinking, answer) of the text so far (see the module docstring)."""
        if not final and START.startswith(text):
            return "", ""  # may still become <think>
        if text.startswith(START):
            body = text[len(START) :]
        elif self.thinks_without_start:
            body = text
        else:
            return "", text
        end = body.find(END)
        if end < 0:
            return (body if final else held_back(body, END)), ""
        return body[:end], body[end + len(END) :]

    def split(self, text: str) -> tuple[str | None, str]:
        """(thinking or None, answer) of a whole reply."""
        thinking, answer = self.partial(text, final=True)
        has_thinking = text.startswith(START) or (self.thinks_without_start and bool(text))
        return (thinking if has_thinking else None), answer

    def grammar(self) -> str:
        """Lark rules of `start`: the thinking, then the rule `reply`."""
        raise NotImplementedError


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinks_without_start = False

    def grammar(self) -> str:
        return f'start: ("{START}" think_body THINK_WS)? reply\n' + _THINK_RULES


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_without_start = True

    def grammar(self) -> str:
        return f'start: "{START}"? think_body THINK_WS reply\n' + _THINK_RULES


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError naming the ones there are."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}"
        )
    return parser()
