"""Speculative decoding under a grammar: constrained requests get drafts (cut to the prefix
their grammar accepts), every verified position is masked by the grammar, and the matcher
advances over every kept token. Greedy outputs equal those without speculation, sampled ones
stay valid, and rejection sampling keeps the grammar-masked target distribution."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from so_constraints import CHOICES, MAX_TOKENS, REGEX, SCHEMA

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.config import TINY_RANDOM_MODEL
from pagedllm.sampling.grammar_mask import TokenBitmask, apply_token_bitmask
from pagedllm.sampling.verification import verification_rows
from pagedllm.sampling_params import SamplingParams as Params
from pagedllm.spec_decode import RejectionSampler
from pagedllm.structured_output.drafts import cut_drafts, grammar_valid_prefix, mask_rows
from pagedllm.structured_output.manager import DraftCuts, consume_run

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft_model", "model": TINY_RANDOM_MODEL, "num_speculative_tokens": 3}
ENGINE = dict(device="cpu", block_size=8, max_model_len=256, num_gpu_blocks=512, seed=0)

# prompts that repeat text of the outputs they constrain, so n-gram lookups find drafts
JSON_PROMPT = '{"done": true, "color": "red", "name": "ab"} {"done": false, "color": "blue", '
REGEX_PROMPT = "ab12-xy.com cd345-abc.org ab12-xy.com cd"
CHOICE_PROMPT = "gamma delta alpha beta gamma delta gamma"


def constrained(temperature: float = 0.0, seed: int | None = None) -> list[SamplingParams]:
    kinds = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
    ]
    return [
        SamplingParams(
            temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=so
        )
        for so in kinds
    ]


PROMPTS = [JSON_PROMPT, REGEX_PROMPT, CHOICE_PROMPT]


def assert_valid(outputs) -> None:
    """JSON schema, regex, choice: in `PROMPTS`' order, each ending with `stop`."""
    json_out, regex_out, choice_out = (o.outputs[0] for o in outputs)
    jsonschema.validate(json.loads(json_out.text), SCHEMA)
    assert re.fullmatch(REGEX, regex_out.text)
    assert choice_out.text in CHOICES
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain_greedy():
    return token_ids(LLM(**ENGINE).generate(PROMPTS, constrained(), use_tqdm=False))


@pytest.fixture(scope="module")
def ngram_run():
    llm = LLM(speculative_config=NGRAM, **ENGINE)
    return llm, llm.generate(PROMPTS, constrained(), use_tqdm=False)


def test_greedy_ngram_speculation_keeps_constrained_outputs(plain_greedy, ngram_run):
    _, outs = ngram_run
    assert_valid(outs)
    assert token_ids(outs) == plain_greedy


def test_constrained_requests_get_drafts_and_accept_some(ngram_run):
    llm, _ = ngram_run
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_greedy_self_draft_keeps_outputs_and_accepts_every_verified_draft(plain_greedy):
    # the target as its own draft: a draft the grammar allows is the masked argmax too, so
    # every draft that reaches verification is accepted (the others were cut before)
    llm = LLM(speculative_config=SELF_DRAFT, **ENGINE)
    outs = llm.generate(PROMPTS, constrained(), use_tqdm=False)
    assert_valid(outs)
    assert token_ids(outs) == plain_greedy
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_drafts_the_grammar_rejects_are_cut_before_verification():
    # the prompt's recurring text continues "ab" with "xy", which the regex forbids: the
    # n-gram proposer offers it, the grammar cuts it, and only what is kept is verified
    llm = LLM(speculative_config=NGRAM, **ENGINE)
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="(ab)+c")
    )
    (out,) = llm.generate(["abxyabxyabxyab"], params, use_tqdm=False)
    assert re.fullmatch("(ab)+c", out.outputs[0].text)
    cuts = llm.llm_engine.structured_output.draft_cuts
    assert cuts.proposed > cuts.kept
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] == cuts.kept


def test_a_finished_grammar_takes_its_eos_while_another_row_accepts_drafts():
    # with 3 drafts "delta" is complete (its matcher stopped) one step before it samples
    # EOS, in a step where the regex request accepts its drafts: the EOS must end it with
    # `stop`, as without speculation, not break its grammar
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(**so)
        )
        for so in ({"regex": "(ab){30}"}, {"choice": ["delta"]})
    ]
    prompts = ["abababab", "delta delta"]
    plain = LLM(**ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(speculative_config={**NGRAM, "num_speculative_tokens": 3}, **ENGINE)
    spec = llm.generate(prompts, params, use_tqdm=False)

    def results(outs):
        return [(c.token_ids, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]

    assert results(spec) == results(plain)
    assert [reason for _, reason, _ in results(spec)] == ["stop", "stop"]
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0


def test_sampled_constrained_outputs_stay_valid_with_speculation(ngram_run):
    llm, _ = ngram_run
    for seed in range(6):
        assert_valid(llm.generate(PROMPTS, constrained(1.0, seed), use_tqdm=False))


def test_mixed_batch_of_constrained_and_free_requests_with_speculation(ngram_run):
    llm, _ = ngram_run
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    prompts = [*PROMPTS, "abab abab abab", *PROMPTS]
    params = [*constrained(1.0, 1), free, *constrained(0.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_valid(outs[:3])
    assert_valid(outs[4:])
    assert len(outs[3].outputs[0].token_ids) == 24


def test_constrained_n_samples_each_follow_their_grammar_with_speculation(ngram_run):
    llm, _ = ngram_run
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, structured_outputs=so
    )
    (out,) = llm.generate([JSON_PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert completion.finish_reason == "stop"


def test_a_failing_request_in_a_verification_step_leaves_constrained_ones_intact(
    fail_sampling_of_seed, plain_greedy
):
    # a free request whose sampling always fails joins while the constrained ones verify
    # drafts: each request's rows are retried alone (the grammar mask cut to them), only the
    # failing one ends, and the constrained outputs are those of plain greedy decoding
    fail_sampling_of_seed(13)
    engine = LLM(speculative_config=NGRAM, **ENGINE).llm_engine
    verify = engine.spec.verify
    retried_masks = []

    def recording_verify(step, logits, requests, rows=None, grammar_mask=None):
        if rows is not None and grammar_mask is not None:
            retried_masks.append(len(grammar_mask.rows))
        return verify(step, logits, requests, rows, grammar_mask)

    engine.spec.verify = recording_verify
    for i, (prompt, params) in enumerate(zip(PROMPTS, constrained())):
        engine.add_request(str(i), prompt, params)
    finals = {}

    def step():
        finals.update({o.request_id: o for o in engine.step() if o.finished})

    while not engine.get_stats()["spec_decode_num_drafts"]:
        step()
    engine.add_request("bad", "Hello", SamplingParams(temperature=1.0, seed=13, max_tokens=4))
    while engine.has_unfinished_requests():
        step()
    assert finals["bad"].outputs[0].finish_reason == "abort"
    assert any(n > 1 for n in retried_masks)  # a constrained sample retried with its drafts
    outs = [finals[str(i)] for i in range(len(PROMPTS))]
    assert_valid(outs)
    assert token_ids(outs) == plain_greedy


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_with_speculation_match_plain_greedy(mode):
    engine = dict(
        device="cpu", block_size=4, max_model_len=168, swap_space=0.05, seed=0,
        num_gpu_blocks=52, preemption_mode=mode,
    )  # fmt: skip
    prompts = PROMPTS * 2
    params = constrained() * 2
    plain = LLM(**engine).generate(prompts, params, use_tqdm=False)
    llm = LLM(speculative_config=NGRAM, **engine)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats[f"num_preemptions_{mode}"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert_valid(outs[:3])
    assert_valid(outs[3:])
    assert token_ids(outs) == token_ids(plain)


# ---- the pieces ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def regex_matcher():
    """A fresh matcher of `(ab|cd){2}` over the built-in byte vocabulary (and its EOS)."""
    engine = LLM(**ENGINE).llm_engine
    manager = engine.structured_output
    template = manager.compile(StructuredOutputsParams(regex="(ab|cd){2}")).result()
    return template, engine.eos_token_ids


def ids(text: str) -> list[int]:
    return list(text.encode())  # the built-in tokenizer: token id = byte


def test_grammar_cuts_drafts_at_the_first_rejected_token(regex_matcher):
    template, eos = regex_matcher
    matcher = template.deep_copy()
    assert grammar_valid_prefix(matcher, ids("abcd"), eos) == 4
    assert grammar_valid_prefix(matcher, ids("abxd"), eos) == 2
    assert grammar_valid_prefix(matcher, ids("x"), eos) == 0
    # a closing EOS is left to verification (nothing follows it to mask)
    assert grammar_valid_prefix(matcher, [*ids("abcd"), eos[0]], eos) == 4
    # validation leaves the matcher where it was
    assert matcher.validate_tokens(ids("cdab")) == 4


def test_a_stopped_matcher_consumes_a_run_of_its_eos(regex_matcher):
    template, eos = regex_matcher
    matcher = template.deep_copy()
    assert matcher.consume_tokens(ids("abcd")) and matcher.is_stopped()
    assert consume_run(matcher, [eos[0]])
    assert not consume_run(template.deep_copy(), ids("abx"))


def test_cut_drafts_trims_constrained_sequences_only(regex_matcher):
    template, eos = regex_matcher
    matcher = template.deep_copy()
    seq_ids = np.array([3, 5, 8])
    counts = np.array([3, 3, 2])
    drafts = np.array([*ids("axy"), *ids("abq"), *ids("zz")])
    # sequence 5 is constrained: its run "abq" keeps "ab"; 3 and 8 are free
    tally = DraftCuts()
    kept = cut_drafts(seq_ids, counts, drafts, {5: matcher}, eos, tally)
    assert kept is not None
    assert (tally.proposed, tally.kept) == (3, 2)
    assert kept[0].tolist() == [3, 5, 8]
    assert kept[1].tolist() == [3, 2, 2]
    assert kept[2].tolist() == [*ids("axy"), *ids("ab"), *ids("zz")]
    # nothing to cut: the scheduler's drafts stand
    assert cut_drafts(seq_ids, counts, drafts, {}, eos) is None


def test_verification_mask_rows_follow_each_samples_positions():
    # samples 0..3 with drafts 2, 0, 1, 3; samples 0 and 2 constrained (3 + 2 mask rows)
    d = np.array([2, 0, 1, 3])
    logit_rows, bit_rows = mask_rows([0, 2], d)
    assert logit_rows.tolist() == [0, 1, 2, 4, 5]
    assert bit_rows.tolist() == [0, 1, 2, 3, 4]
    # retried for samples 2 and 3 only: the logits hold 2 + 4 rows, sample 2's come first
    logit_rows, bit_rows = mask_rows([0, 2], d, samples=[2, 3])
    assert logit_rows.tolist() == [0, 1]
    assert bit_rows.tolist() == [3, 4]


VOCAB = 6
ALPHA = 1e-6  # a correct sampler fails once in a million runs


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0  # nothing drawn outside the mask
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def bitmask_row(allowed: list[int]) -> list[int]:
    return [sum(1 << t for t in allowed)]


def test_rejection_sampling_keeps_the_grammar_masked_target_distribution():
    # every trial: one draft (token 1) judged at position 0, a bonus at position 1; the
    # grammar allows {1, 3, 4} then {0, 2, 4}; alternate trials are free (no mask)
    trials = 40_000
    base = torch.tensor([[0.3, 1.2, -0.5, 0.8, 0.0, -1.0], [1.0, -0.2, 0.4, 0.1, 0.9, -0.6]])
    logits = base.repeat(trials, 1)
    d = np.ones(trials, dtype=np.int64)
    constrained_samples = list(range(0, trials, 2))
    bits = torch.tensor([bitmask_row([1, 3, 4]), bitmask_row([0, 2, 4])], dtype=torch.int32)
    bits = bits.repeat(len(constrained_samples), 1)
    logit_rows, bit_rows = mask_rows(constrained_samples, d)
    mask = TokenBitmask(torch.from_numpy(logit_rows), bits[torch.from_numpy(bit_rows)])
    meta = verification_rows(
        [Params(temperature=1.0)] * trials,
        [[] for _ in range(trials)],
        [[0]] * trials,
        [0] * trials,
        [[1]] * trials,
        vocab_size=VOCAB,
        stop_token_ids=[()] * trials,
        device="cpu",
    )
    sampler = RejectionSampler(torch.Generator().manual_seed(3))
    out = sampler(apply_token_bitmask(logits, mask), meta, d, torch.ones(trials).long())
    tokens = out.token_ids.numpy()
    starts = np.cumsum(out.num_tokens) - out.num_tokens
    is_constrained = np.zeros(trials, dtype=bool)
    is_constrained[constrained_samples] = True
    for masked, allowed in ((True, ([1, 3, 4], [0, 2, 4])), (False, (range(6), range(6)))):
        pick = is_constrained == masked
        for position in (0, 1):
            keep = np.zeros(VOCAB, dtype=bool)
            keep[list(allowed[position])] = True
            p = base[position].masked_fill(torch.from_numpy(~keep), float("-inf")).softmax(-1)
            has = pick & (out.num_tokens > position)
            drawn = tokens[starts[has] + position]
            counts = np.bincount(drawn, minlength=VOCAB)
            assert chi_square_p_value(counts, p.numpy()) > ALPHA
