"""vLLM's `use_beam_search` on `/v1/completions` through the official `openai` client: the n
best of best_of beams, as `LLM.beam_search` finds them; fields that only sampling reads are a
400 naming the field."""

from __future__ import annotations

import openai
import pytest

from pagedllm import LLM
from pagedllm.sampling_params import BeamSearchParams

from server_util import ENGINE, MODEL

PROMPT = "paged attention"


def test_beam_search_returns_the_n_best_beams_of_best_of(client, server):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        n=2,
        best_of=3,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    llm = LLM(**ENGINE)
    (offline,) = llm.beam_search(PROMPT, BeamSearchParams(3, 5, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    prompt_len = len(tokenizer.encode(PROMPT))
    expected = [tokenizer.decode(s.tokens[prompt_len:]) for s in offline.sequences[:2]]
    assert [c.text for c in out.choices] == expected
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 10
    server.wait_idle()


def test_beam_width_is_n_without_best_of(client):
    out = client.completions.create(
        model=MODEL, prompt=[PROMPT, "x"], max_tokens=3, n=2, extra_body={"use_beam_search": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 0.8), ("top_p", 0.5), ("logprobs", 2), ("stop", ["x"]), ("stream", True)],
)
def test_a_sampling_field_with_beam_search_is_a_400_naming_it(client, field, value):
    body = {"use_beam_search": True, field: value}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=body)
    assert exc.value.param == field and "use_beam_search" in exc.value.message


@pytest.mark.parametrize(("body", "param"), [({"n": 3, "best_of": 2}, "n"), ({"n": 0}, "n")])
def test_a_bad_beam_width_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"use_beam_search": True, **body}
        )
    assert exc.value.param == param


def test_length_penalty_without_beam_search_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"length_penalty": 0.5}
        )
    assert exc.value.param == "length_penalty"
