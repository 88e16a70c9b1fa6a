"""Chat rendering (`chat/template.py`), shared by the server and `LLM.chat`."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.chat.template import encode_chat, load_chat_template, render_chat

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]


def test_default_template_renders_each_message_then_the_assistant_header():
    text = render_chat(CONVERSATION)
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_text_content_parts_are_joined():
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert render_chat(parts) == render_chat([{"role": "user", "content": "ab"}])


def test_custom_template_file_is_used(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert (
        render_chat(CONVERSATION, chat_template=load_chat_template(str(path))) == "[Be brief.][Hi]"
    )


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"content": "x"}], ["hello"]],
)
def test_bad_messages_are_a_value_error(messages):
    with pytest.raises(ValueError, match="messages"):
        render_chat(messages)


class _BosTokenizer:
    """Encodes "<s>" as token 1 and every other character as its code point; adds BOS."""

    bos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [1] + [1 if piece == "<s>" else ord(piece) for piece in _split_bos(text)]


def _split_bos(text: str) -> list[str]:
    head, sep, tail = text.partition("<s>")
    return list(head) + ([sep] + _split_bos(tail) if sep else [])


def test_encode_chat_drops_the_doubled_bos_of_a_template_that_writes_it():
    assert encode_chat(_BosTokenizer(), "<s>hi") == [1, ord("h"), ord("i")]
    assert encode_chat(_BosTokenizer(), "hi") == [1, ord("h"), ord("i")]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_gpu_blocks=32)


def test_llm_chat_equals_generate_on_the_rendered_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    (chat,) = llm.chat(CONVERSATION, params, use_tqdm=False)
    (plain,) = llm.generate(render_chat(CONVERSATION), params, use_tqdm=False)
    assert chat.outputs[0].text == plain.outputs[0].text
    assert chat.prompt == plain.prompt


def test_llm_chat_takes_a_list_of_conversations(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    other = [{"role": "user", "content": "Bye"}]
    outputs = llm.chat([CONVERSATION, other], params, use_tqdm=False)
    assert [o.prompt for o in outputs] == [render_chat(CONVERSATION), render_chat(other)]


def test_llm_chat_uses_the_given_template(llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    (out,) = llm.chat(
        CONVERSATION, params, chat_template="{{ messages[-1]['content'] }}!", use_tqdm=False
    )
    assert out.prompt == "Hi!"
