"""A checkpoint with a `tokenizer.json` (multi-byte tokens, a model vocabulary wider than the
tokenizer's): its vocabulary is handed to the grammar engine, and constrained outputs follow
the constraint, never using ids past the tokenizer's."""

from __future__ import annotations

import json
import re

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

from model_factory import TOKENIZER_VOCAB_SIZE, save_tiny_checkpoint


@pytest.fixture(scope="module")
def hf_llm(tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", seed=5)
    return LLM(str(folder), device="cpu", block_size=8, max_model_len=128, num_gpu_blocks=64)


def test_constrained_outputs_with_a_tokenizer_json_vocabulary(hf_llm):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "w": {"enum": ["quick", "lazy dog"]}},
        "required": ["ok", "w"],
        "additionalProperties": False,
    }
    regex = r"[0-9]{2}-(fox|cat)"
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=60, structured_outputs=so)
        for so in (StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=regex))
        for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))
    ]
    outs = hf_llm.generate(["hello world"] * len(params), params, use_tqdm=False)
    for out in outs:
        (completion,) = out.outputs
        assert completion.finish_reason == "stop"
        assert max(completion.token_ids) < TOKENIZER_VOCAB_SIZE
    for out in outs[:3]:
        assert set(json.loads(out.outputs[0].text)) == {"ok", "w"}
    for out in outs[3:]:
        assert re.fullmatch(regex, out.outputs[0].text)
