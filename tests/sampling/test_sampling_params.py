"""SamplingParams: vLLM defaults, normalization, and a ValueError naming each bad field."""

import os
import subprocess
import sys

import pytest

import pagedllm
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams

BAD_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("best_of", 1),  # below n=2, set by the test
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", None),
    ("min_tokens", -1),
    ("min_tokens", 17),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("stop", ""),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", 3),
    ("ignore_eos", 1),
    ("skip_special_tokens", None),
    ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=lambda v: repr(v))
def test_invalid_field_raises_value_error_naming_it(name, value):
    extra = {"n": 2} if name == "best_of" else {}
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}, **extra)


@pytest.mark.parametrize(
    ("name", "value", "limit"),
    [
        ("max_tokens", 2**64, 2**63 - 1),
        ("max_tokens", 2**63, 2**63 - 1),
        ("n", 2**70, 2**63 - 1),
        ("best_of", 2**64, 2**63 - 1),
        ("min_tokens", 2**63, 2**63 - 1),
        ("logprobs", 2**64, 2**63 - 1),
        ("top_k", 2**63, 2**63 - 1),
        ("seed", 2**64, 2**64 - 1),
        ("seed", -(2**63) - 1, -(2**63)),
        ("stop_token_ids", [3, 2**32], 2**32 - 1),
    ],
    ids=repr,
)
def test_integer_beyond_its_type_is_a_value_error_naming_field_and_limit(name, value, limit):
    with pytest.raises(ValueError, match=name) as info:  # never a bare OverflowError
        SamplingParams(**{name: value})
    assert str(limit) in str(info.value)


def test_integer_fields_accept_the_largest_value_of_their_type():
    big = 2**63 - 1
    p = SamplingParams(
        max_tokens=big,
        min_tokens=big,
        n=big,
        best_of=big,
        logprobs=big,
        top_k=big,
        seed=2**64 - 1,
        stop_token_ids=[2**32 - 1],
    )
    assert p.num_samples == big
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_error_message_shows_the_bad_value():
    with pytest.raises(ValueError, match=r"-0\.5"):
        SamplingParams(temperature=-0.5)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs, p.best_of) == (None, 16, 0, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (
        False,
        True,
        False,
    )


def test_boundary_values_are_accepted():
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        min_tokens=16,
        max_tokens=16,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        logprobs=0,
        seed=-3,
        n=3,
        best_of=3,
    )


def test_zero_temperature_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_top_k_zero_and_minus_one_both_mean_off():
    assert not SamplingParams(top_k=0).uses_top_k
    assert not SamplingParams(top_k=-1).uses_top_k
    assert SamplingParams(top_k=1).uses_top_k


def test_stop_string_is_normalized_to_list():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams().stop == []


def test_stop_token_ids_are_normalized_to_list():
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams().stop_token_ids == []


def test_all_stop_token_ids_adds_eos_unless_ignored():
    assert SamplingParams(stop_token_ids=[5]).all_stop_token_ids(2) == [5, 2]
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(2) == [5]
    assert SamplingParams().all_stop_token_ids(None) == []


def test_all_stop_token_ids_adds_each_of_several_eos_ids_once():
    assert SamplingParams(stop_token_ids=[5, 7]).all_stop_token_ids((2, 7, 9)) == [5, 7, 2, 9]
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids((2, 7)) == [5]


def test_num_samples_is_best_of_when_given():
    assert SamplingParams(n=2).num_samples == 2
    assert SamplingParams(n=2, best_of=5).num_samples == 5


def test_penalties_flag_only_when_a_penalty_is_set():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties


def test_repr_is_readable():
    text = repr(SamplingParams(temperature=0.5, stop="x"))
    assert text.startswith("SamplingParams(") and "temperature=0.5" in text and "stop=['x']" in text


def test_completion_output_finished_follows_finish_reason():
    out = CompletionOutput(index=0, text="hi", token_ids=[1, 2])
    assert not out.finished()
    out.finish_reason = "length"
    assert out.finished()


def test_params_and_outputs_import_without_torch():
    package_root = os.path.dirname(os.path.dirname(pagedllm.__file__))
    env = {**os.environ, "PYTHONPATH": package_root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = (
        "import sys; import pagedllm.sampling_params, pagedllm.outputs; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize(
    "name, value",
    [
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {1: float("inf")}),
        ("logit_bias", {"1": 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", [1, 2]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("allowed_token_ids", [True]),
        ("bad_words", "word"),
        ("bad_words", ["ok", " "]),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 1.0),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
        ("truncate_prompt_tokens", 2.0),
    ],
)
def test_token_control_fields_refuse_bad_values_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}"):
        SamplingParams(**{name: value})


def test_bad_words_tokenize_with_and_without_a_leading_space():
    vocab = {"bad": [7], " bad": [9], "two words": [1, 2], " two words": [3, 2]}
    params = SamplingParams(bad_words=["bad", " two words"])
    tokenized = params.with_bad_words_tokenized(vocab.__getitem__)
    assert tokenized.bad_words_token_ids == [[7], [9], [1, 2], [3, 2]]
    assert params.bad_words_token_ids == []  # the caller's params are left as they were
