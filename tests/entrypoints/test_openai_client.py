"""The official `openai` client against a live server: completions, chat, streaming, n, token-id
prompts, logprobs, usage, models."""

from __future__ import annotations

from server_util import MODEL

GREEDY = dict(model=MODEL, temperature=0, max_tokens=12)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_returns_text_and_usage(client):
    out = client.completions.create(prompt="Hello there", **GREEDY)
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(b"Hello there") + 1  # BOS + bytes
    assert out.usage.completion_tokens >= 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_greedy_completion_is_deterministic(client):
    a = client.completions.create(prompt="abc", **GREEDY)
    b = client.completions.create(prompt="abc", **GREEDY)
    assert a.choices[0].text == b.choices[0].text


def test_streamed_completion_equals_non_streamed(client):
    full = client.completions.create(prompt="stream me", **GREEDY)
    chunks = list(client.completions.create(prompt="stream me", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stream_include_usage_sends_a_final_usage_chunk(client):
    full = client.completions.create(prompt="usage", **GREEDY)
    chunks = list(
        client.completions.create(
            prompt="usage", stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_token_id_prompt_matches_the_text_prompt(client):
    text = client.completions.create(prompt="hi", **GREEDY)
    ids = client.completions.create(prompt=[256, ord("h"), ord("i")], **GREEDY)
    assert ids.choices[0].text == text.choices[0].text
    assert ids.usage.prompt_tokens == 3


def test_list_of_prompts_gives_one_choice_each_in_order(client):
    prompts = ["one", "two", "three"]
    batch = client.completions.create(prompt=prompts, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, batch.choices):
        single = client.completions.create(prompt=prompt, **GREEDY)
        assert choice.text == single.choices[0].text


def test_list_of_token_id_prompts(client):
    batch = client.completions.create(prompt=[[256, 97], [256, 98, 99]], **GREEDY)
    assert len(batch.choices) == 2
    assert batch.usage.prompt_tokens == 5


def test_n_returns_n_choices(client):
    out = client.completions.create(
        model=MODEL, prompt="sample", n=3, temperature=1.0, seed=7, max_tokens=6
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]


def test_logprobs_cover_every_generated_token(client):
    out = client.completions.create(prompt="lp", logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.tokens)
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the sampled token is the most likely one of its step
    for top, value in zip(lp.top_logprobs, lp.token_logprobs):
        assert abs(max(top.values()) - value) < 1e-5


def test_extra_body_sampling_fields_are_accepted(client):
    out = client.completions.create(
        prompt="extras",
        extra_body=dict(
            top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=4, priority=0
        ),
        **GREEDY,
    )
    assert out.usage.completion_tokens == GREEDY["max_tokens"]


def test_chat_completion_returns_an_assistant_message(client):
    out = client.chat.completions.create(messages=[{"role": "user", "content": "Hi!"}], **GREEDY)
    message = out.choices[0].message
    assert message.role == "assistant"
    assert isinstance(message.content, str)
    assert out.usage.completion_tokens >= 1


def test_streamed_chat_deltas_concatenate_to_the_message(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me something."},
    ]
    full = client.chat.completions.create(messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_echo_of_a_token_id_prompt_prepends_its_decoded_text(client):
    plain = client.completions.create(prompt=[256, ord("h"), ord("i")], **GREEDY)
    echoed = client.completions.create(prompt=[256, ord("h"), ord("i")], echo=True, **GREEDY)
    assert echoed.choices[0].text == "hi" + plain.choices[0].text


def test_streamed_echo_equals_non_streamed_echo(client):
    for prompt in ([[256, ord("a")], [256, ord("b")]], ["bc", "de"]):
        full = client.completions.create(prompt=prompt, echo=True, **GREEDY)
        chunks = list(client.completions.create(prompt=prompt, echo=True, stream=True, **GREEDY))
        for index in (0, 1):
            streamed = "".join(c.choices[0].text for c in chunks if c.choices[0].index == index)
            assert streamed == full.choices[index].text
        assert [c.text[:1] for c in full.choices] in (["a", "b"], ["b", "d"])
