"""Speculative decoding end to end: greedy outputs are identical with and without n-gram
speculation for the Llama, Qwen2 and Qwen3 test models, under every strategy, with prefix caching
on and off, under preemption (recompute and swap) and for n > 1; stops falling inside an accepted
run end where they would without speculation; no block is leaked."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

import spec_util
from model_factory import save_tiny_checkpoint
from spec_util import assert_ran_clean, token_ids

MAX_NEW = 20
# prompts that repeat themselves, and greedy outputs of the random models that fall into loops:
# both give the n-gram proposer something to find
PROMPTS = [
    [5, 17, 99, 3] * 3,
    list(range(20, 41)) * 2,
    [7] * 9 + [11, 12, 13],
    list(range(100, 133)),
    [9, 8, 7, 6, 9, 8, 7],
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def checkpoint(name: str, tmp_path_factory):
    """(checkpoint folder, greedy outputs without speculation)."""
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp(name), name, seed=3)
    _, outs = generate(folder, None)
    return folder, token_ids(outs)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    return checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return checkpoint("llama", tmp_path_factory)


def generate(folder, spec, **kwargs):
    return spec_util.generate(folder, spec, PROMPTS, MAX_NEW, **kwargs)


def assert_spec_ran_clean(llm) -> dict:
    """Drafts were verified and some accepted; every block went back; invariants hold."""
    return assert_ran_clean(llm, accepted=True)


@pytest.mark.parametrize("scheduling", ["unified", "prefill_first", "chunked_prefill"])
def test_greedy_outputs_match_without_speculation(family, scheduling):
    folder, expected = family
    llm, outs = generate(folder, NGRAM, scheduling=scheduling)
    assert token_ids(outs) == expected
    assert_spec_ran_clean(llm)


def test_greedy_outputs_match_without_prefix_caching(family):
    folder, expected = family
    llm, outs = generate(folder, NGRAM, enable_prefix_caching=False)
    assert token_ids(outs) == expected
    assert_spec_ran_clean(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_match_under_preemption(llama, mode):
    folder, expected = llama
    # 5 requests of up to 42 + 24 tokens in 40 blocks of 4: decodes run out and preempt
    llm, outs = generate(folder, NGRAM, num_gpu_blocks=40, max_model_len=128, preemption_mode=mode)
    assert token_ids(outs) == expected
    stats = assert_spec_ran_clean(llm)
    assert stats["num_preemptions"] > 0


def test_n_above_one_matches(llama):
    folder, expected = llama
    llm, outs = generate(folder, NGRAM, n=2)
    assert token_ids(outs) == [[e[0], e[0]] for e in expected]
    assert_spec_ran_clean(llm)


def stop_case(folder, expected, **params):
    """Outputs with and without speculation under the same stop parameters."""
    outs = []
    for spec in (None, NGRAM):
        sp = SamplingParams(**({"temperature": 0.0, "max_tokens": MAX_NEW} | params))
        llm, got = generate(folder, spec, params=sp)
        outs.append(
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in got for c in o.outputs]
        )
    # the speculative run accepted drafts, so stops had runs to cut
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    return outs


def test_stops_inside_accepted_runs_end_where_they_would_without_speculation(llama):
    folder, expected = llama
    # a token that first appears late in a looping output: it lands inside accepted runs
    looping = max(expected, key=lambda e: len(e[0]) - len(set(e[0])))[0]
    stop_id = looping[-3]
    plain, spec = stop_case(folder, expected, stop_token_ids=[stop_id])
    assert plain == spec
    assert any(reason == "stop" for _, _, reason, _ in spec)
    plain, spec = stop_case(folder, expected, max_tokens=13, ignore_eos=True)
    assert plain == spec
    assert all(len(tokens) == 13 for tokens, *_ in spec)
    # a stop string cut out of the middle of the looping output's text
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4)
    text = llm.get_tokenizer().decode(looping)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    plain, spec = stop_case(folder, expected, stop=[stop], ignore_eos=True)
    assert plain == spec
    assert any(reason == "stop" and stop_reason == stop for _, _, reason, stop_reason in spec)


def test_seeded_sampling_with_speculation_repeats_and_reports_logprobs(llama):
    folder, _ = llama
    params = SamplingParams(
        temperature=0.8, seed=7, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2
    )
    runs = []
    for extra in (0, 2):
        llm = LLM(
            str(folder), dtype="float32", device="cpu", block_size=4, speculative_config=NGRAM
        )
        others = [{"prompt_token_ids": p} for p in PROMPTS[:extra]]
        prompts = others + [{"prompt_token_ids": PROMPTS[1]}]
        free = [SamplingParams(temperature=1.0, max_tokens=MAX_NEW)] * extra
        out = llm.generate(prompts, free + [params], use_tqdm=False)[-1].outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == MAX_NEW
        assert all(token in entry for token, entry in zip(out.token_ids, out.logprobs))
        runs.append(out.token_ids)
        stats = llm.llm_engine.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert runs[0] == runs[1]
