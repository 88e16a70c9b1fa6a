"""vLLM's sampling fields over HTTP through the official `openai` client (logit_bias natively,
the others in `extra_body`), unknown fields refused with a 400 naming them, and vLLM's
`/tokenize` and `/detokenize`. The served model is the built-in byte-level one: token 65 is
"A", 256 is BOS."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_util import MODEL

GREEDY = dict(model=MODEL, temperature=0, max_tokens=6)
LETTERS = [ord(c) for c in "abcde"]
CHAT = [{"role": "user", "content": "Hi!"}]
VOCAB = 259


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    return exc.value


def test_logit_bias_makes_a_token_the_greedy_choice(client):
    out = client.completions.create(prompt="x", logit_bias={"65": 100}, **GREEDY)
    assert out.choices[0].text == "A" * GREEDY["max_tokens"]


def test_logit_bias_beyond_100_is_clipped_not_refused(client):
    out = client.chat.completions.create(messages=CHAT, logit_bias={"66": 5000}, **GREEDY)
    assert out.choices[0].message.content == "B" * GREEDY["max_tokens"]


@pytest.mark.parametrize("key", ["not-an-id", str(VOCAB)])
def test_logit_bias_key_that_is_no_token_id_is_a_400(client, key):
    error = refused(lambda: client.completions.create(prompt="x", logit_bias={key: 1}, **GREEDY))
    assert error.param == "logit_bias" and key in error.message


def test_allowed_token_ids_are_the_only_tokens_generated(client):
    out = client.completions.create(prompt="x", extra_body={"allowed_token_ids": LETTERS}, **GREEDY)
    assert set(out.choices[0].text) <= set("abcde")


def test_allowed_token_id_outside_the_vocabulary_is_a_400(client):
    error = refused(
        lambda: client.completions.create(
            prompt="x", extra_body={"allowed_token_ids": [1, VOCAB]}, **GREEDY
        )
    )
    assert error.param == "allowed_token_ids"


def test_bad_words_keep_a_word_out_of_greedy_output(client):
    fields = {"allowed_token_ids": LETTERS}
    plain = client.completions.create(prompt="x", extra_body=fields, **GREEDY).choices[0].text
    banned = plain[0]
    out = client.completions.create(
        prompt="x", extra_body={**fields, "bad_words": [banned]}, **GREEDY
    )
    text = out.choices[0].text
    assert banned not in text and text != plain


def test_completion_prompt_logprobs_cover_every_prompt_token(client):
    out = client.completions.create(prompt="hello", extra_body={"prompt_logprobs": 2}, **GREEDY)
    entries = out.choices[0].prompt_logprobs
    prompt_ids = [256, *b"hello"]
    assert len(entries) == len(prompt_ids) == out.usage.prompt_tokens
    assert entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(token) in entry
        # the prompt token and the 2 most likely ones (one entry fewer when it is one of them)
        assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) in (2, 3)
        assert all(v["logprob"] <= 0 for v in entry.values())


def test_chat_prompt_logprobs_are_a_response_field(client):
    out = client.chat.completions.create(messages=CHAT, extra_body={"prompt_logprobs": 0}, **GREEDY)
    entries = out.prompt_logprobs
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 for e in entries[1:])


def test_prompt_logprobs_with_stream_is_a_400(client):
    error = refused(
        lambda: client.completions.create(
            prompt="x", stream=True, extra_body={"prompt_logprobs": 1}, **GREEDY
        )
    )
    assert error.param == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    fields = {"truncate_prompt_tokens": 3}
    out = client.completions.create(prompt="a long prompt", extra_body=fields, **GREEDY)
    same = client.completions.create(prompt=list(b"mpt"), **GREEDY)
    assert out.usage.prompt_tokens == 3
    assert out.choices[0].text == same.choices[0].text


def test_truncate_prompt_tokens_lets_an_overlong_prompt_in(client):
    fields = {"truncate_prompt_tokens": 10}
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "x" * 1000}], extra_body=fields, **GREEDY
    )
    assert out.usage.prompt_tokens == 10


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    full = client.completions.create(prompt="usage", **GREEDY)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(prompt="usage", stream=True, stream_options=options, **GREEDY)
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens


def test_chat_continuous_usage_stats_put_usage_in_every_chunk(client):
    options = {"continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(messages=CHAT, stream=True, stream_options=options, **GREEDY)
    )
    assert chunks[0].usage.completion_tokens == 0
    assert chunks[-1].usage.completion_tokens == GREEDY["max_tokens"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_unknown_field_is_a_400_naming_it(client, endpoint):
    def call():
        extra = {"extra_body": {"frobnicate": 1}}
        if endpoint == "chat":
            return client.chat.completions.create(messages=CHAT, **GREEDY, **extra)
        return client.completions.create(prompt="x", **GREEDY, **extra)

    error = refused(call)
    assert error.param == "frobnicate"
    assert "frobnicate" in error.message and "not a field this server supports" in error.message


def test_unknown_nested_field_is_a_400_naming_its_path(client):
    options = {"include_usage": True, "bogus": True}
    error = refused(
        lambda: client.completions.create(prompt="x", stream=True, stream_options=options, **GREEDY)
    )
    assert error.param == "stream_options.bogus"


def test_unsupported_openai_field_is_refused_not_dropped(client):
    error = refused(lambda: client.completions.create(prompt="x", suffix="!", **GREEDY))
    assert error.param == "suffix"


def test_no_op_fields_are_accepted(client):
    out = client.chat.completions.create(
        messages=CHAT,
        user="someone",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        extra_body={"safety_identifier": "x", "prompt_cache_key": "y"},
        **GREEDY,
    )
    assert out.choices[0].message.content is not None


def test_message_keys_such_as_name_are_accepted(client):
    messages = [{"role": "user", "content": "Hi!", "name": "alice"}]
    out = client.chat.completions.create(messages=messages, **GREEDY)
    assert out.choices[0].message.content is not None


def test_tokenize_a_prompt(server):
    answer = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).json()
    assert answer == {"count": 3, "max_model_len": 128, "tokens": [256, *b"hi"], "token_strs": None}


def test_tokenize_without_special_tokens_and_with_token_strings(server):
    body = {"prompt": "hi", "add_special_tokens": False, "return_token_strs": True}
    answer = httpx.post(f"{server.url}/tokenize", json=body).json()
    assert answer["tokens"] == list(b"hi") and answer["token_strs"] == ["h", "i"]


def test_tokenize_messages_counts_what_chat_completions_sends(server, client):
    answer = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT, "model": MODEL}).json()
    out = client.chat.completions.create(messages=CHAT, **GREEDY)
    assert answer["count"] == out.usage.prompt_tokens == len(answer["tokens"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": CHAT}, "prompt"),
        ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
        ({"prompt": "a", "model": "other"}, "model"),
        ({"prompt": "a", "extra": 1}, "extra"),
    ],
)
def test_bad_tokenize_request_is_a_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/tokenize", json=body)
    assert response.status_code in (400, 404)
    assert response.json()["error"]["param"] == param


def test_detokenize_round_trips_tokenize(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "round trip"}).json()["tokens"]
    answer = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert answer == {"prompt": "<s>round trip"}


@pytest.mark.parametrize("tokens", [[65, VOCAB], [-1]])
def test_detokenize_of_an_id_outside_the_vocabulary_is_a_400(server, tokens):
    response = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"
