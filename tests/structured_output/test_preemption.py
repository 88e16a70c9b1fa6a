"""Constrained requests on a KV cache too small for all of them: preempted by recompute
(their generated tokens are kept, so each matcher already stands where its sequence does) or
swapped out, they still produce valid output."""

from __future__ import annotations

import json

import jsonschema
import pytest
from so_constraints import MAX_TOKENS, SCHEMA

from pagedllm import LLM, SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_stay_valid(mode):
    llm = LLM(
        device="cpu",
        block_size=4,
        max_model_len=168,
        num_gpu_blocks=42,
        swap_space=0.05,
        preemption_mode=mode,
        seed=0,
    )
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs=so)
        for s in range(4)
    ]
    outs = llm.generate([f"q{i}" for i in range(4)], params, use_tqdm=False)
    assert llm.engine.get_stats()[f"num_preemptions_{mode}"] > 0
    for out in outs:
        (completion,) = out.outputs
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)
