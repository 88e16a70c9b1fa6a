"""Speculation next to structured output: in steps that verify drafts, constrained requests'
positions stay masked by their grammar (their drafts cut to it first; see
tests/structured_output/test_spec_decode_grammar.py), and free requests are unchanged."""

from __future__ import annotations

import re

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

REGEX = r"(ab|cd){2,6}"


def test_constrained_requests_keep_their_grammar_in_speculative_steps():
    kwargs = dict(device="cpu", max_model_len=256)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    prompts = ["abab abab abab", "xyz xyz xyz xyz", "cdcd cdcd"]
    params = [free, free, constrained]
    plain = LLM(**kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(speculative_config=spec, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert re.fullmatch(REGEX, outs[2].outputs[0].text)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0
