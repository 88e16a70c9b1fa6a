"""Speculative decoding and structured output on CUDA: n-gram and draft-model speculation leave
greedy outputs unchanged (verification's logits rows and rejection sampling on the device), and
constrained outputs validate with the grammar's token bitmask applied to logits on the device."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

from model_factory import save_tiny_checkpoint, save_truncated_checkpoint

MAX_NEW = 20
PROMPTS = [[5, 17, 99, 3] * 3, list(range(20, 41)) * 2, [7] * 9 + [11, 12, 13], [9, 8, 7, 6, 9, 8]]
# an object with a boolean and an enum, nothing else (room for it in byte tokens)
SCHEMA = {
    "type": "object",
    "properties": {"done": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["done", "color"],
    "additionalProperties": False,
}
MAX_TOKENS = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def assert_matches_schema(value) -> None:
    # by hand: the device image has no jsonschema
    assert isinstance(value, dict) and set(value) == {"done", "color"}, value
    assert isinstance(value["done"], bool) and value["color"] in ("red", "green", "blue"), value


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


def greedy(folder, dtype, speculative_config=None):
    llm = LLM(
        str(folder),
        dtype=dtype,
        device="cuda",
        block_size=16,
        max_model_len=256,
        num_gpu_blocks=256,
        speculative_config=speculative_config,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_speculation_keeps_greedy_outputs_on_cuda(qwen3, dtype):
    _, plain = greedy(qwen3, dtype)
    llm, speculated = greedy(qwen3, dtype, NGRAM)
    assert speculated == plain
    stats = llm.llm_engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_model_speculation_keeps_greedy_outputs_on_cuda(qwen3, dtype, tmp_path):
    # the draft runs on the device too, over its own mirrored cache
    draft = save_truncated_checkpoint(qwen3, tmp_path / "draft", 1)
    _, plain = greedy(qwen3, dtype)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm, speculated = greedy(qwen3, dtype, config)
    assert speculated == plain
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_on_cuda(temperature):
    llm = LLM(device="cuda", block_size=16, max_model_len=256, num_gpu_blocks=256, seed=0)
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(
            temperature=temperature, seed=s, max_tokens=MAX_TOKENS, structured_outputs=so
        )
        for s in range(6)
    ]
    outs = llm.generate([f"prompt {i}:" for i in range(6)], params, use_tqdm=False)
    for out in outs:
        (completion,) = out.outputs
        assert completion.finish_reason == "stop", completion
        assert_matches_schema(json.loads(completion.text))
