"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens change greedy output
end to end through `LLM.generate` as vLLM specifies; bad ids are a ValueError naming the field."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from model_factory import save_tiny_checkpoint

PROMPT = "The quick brown fox"
MAX = 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("controls"), "llama", seed=3)
    return LLM(str(folder), dtype="float32", device="cpu", block_size=4)


def greedy(llm, prompt=PROMPT, **kwargs) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True, **kwargs)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    return out.outputs[0].token_ids


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_logit_bias_of_100_makes_a_token_the_greedy_choice(llm):
    assert greedy(llm, logit_bias={42: 100.0}) == [42] * MAX


def test_logit_bias_of_minus_100_keeps_a_token_out(llm):
    plain = greedy(llm)
    banned = greedy(llm, logit_bias={plain[0]: -100.0})
    assert plain[0] not in banned and banned != plain


def test_allowed_token_ids_are_the_only_tokens_generated(llm):
    allowed = [3, 50, 77]
    tokens = greedy(llm, allowed_token_ids=allowed)
    assert set(tokens) <= set(allowed)


def test_bad_word_of_one_token_is_never_generated(llm):
    tokenizer = llm.get_tokenizer()
    plain = greedy(llm)
    token = next(t for t in plain if tokenizer.encode(tokenizer.decode([t]), False) == [t])
    word = tokenizer.decode([token])
    tokens = greedy(llm, bad_words=[word])
    assert token not in tokens and tokens != plain


def test_bad_word_of_two_tokens_bans_its_last_token_after_its_first(llm):
    tokenizer = llm.get_tokenizer()
    plain = greedy(llm)
    pair = next(
        plain[i : i + 2]
        for i in range(len(plain) - 1)
        if tokenizer.encode(tokenizer.decode(plain[i : i + 2]).lstrip(), False) == plain[i : i + 2]
    )
    tokens = greedy(llm, bad_words=[tokenizer.decode(pair)])
    assert not contains(tokens, pair)
    i = next(i for i in range(len(plain) - 1) if plain[i : i + 2] == pair)
    # up to the word's first token the output is unchanged; then its last token is banned
    assert tokens[: i + 1] == plain[: i + 1] and tokens[i + 1] != pair[1]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(max_tokens=1, truncate_prompt_tokens=3)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert out.prompt_token_ids == ids[-3:]
    assert greedy(llm, truncate_prompt_tokens=3) == greedy(llm, {"prompt_token_ids": ids[-3:]})


@pytest.mark.parametrize(
    "field, value",
    [("logit_bias", {320: 1.0}), ("allowed_token_ids", [1, 320]), ("prompt_logprobs", 321)],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm, field, value):
    with pytest.raises(ValueError, match=field):
        llm.generate(PROMPT, SamplingParams(**{field: value}), use_tqdm=False)
