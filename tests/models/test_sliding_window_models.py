"""Sliding-window families against transformers (the outside oracle), float32 on the CPU: tiny
random Mistral, Qwen2 with `use_sliding_window`, Gemma 2 and Gemma 3 (text) checkpoints with a
16-token window and prompts several windows long.

- logits of a chunked prefill and decode steps over the paged cache equal transformers' full
  forward (the window masks keys inside blocks that are still kept);
- greedy tokens (32 new) through the engine with chunked prefill and prefix caching equal
  transformers' `generate`, a second request sharing a long prefix hitting the cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    Qwen2Config,
)

from pagedllm import LLM, SamplingParams
from pagedllm._core import min_kv_blocks
from pagedllm.attention.kv_groups import kv_group_layout
from pagedllm.config import EngineArgs
from pagedllm.models import load_model, load_model_config

from engine_util import engine_greedy
from model_factory import PagedRunner, build_hf_model, hf_generate_greedy, save_tiny_tokenizer

WINDOW = 16
_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    sliding_window=WINDOW,
)
_GEMMA = dict(_COMMON, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24)
CONFIGS = {
    "mistral": lambda: MistralConfig(**_COMMON, num_hidden_layers=2),
    # layer 0 full, layers 1-2 sliding (index >= max_window_layers)
    "qwen2": lambda: Qwen2Config(
        **_COMMON, num_hidden_layers=3, use_sliding_window=True, max_window_layers=1
    ),
    # a cap the scores reach (5): the capping matters
    "gemma2": lambda: Gemma2Config(
        **_GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=30.0
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **_GEMMA,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
}
EXPECTED_WINDOWS = {
    "mistral": (WINDOW, WINDOW),
    "qwen2": (0, WINDOW, WINDOW),
    "gemma2": (WINDOW, 0, WINDOW),
    "gemma3": (WINDOW, 0, WINDOW),
}
PROMPT = [(i * 37 + 5) % 300 + 2 for i in range(70)]  # 4+ windows
SHARED = [(i * 11 + 3) % 300 + 2 for i in range(56)]  # a long common prefix: 14 blocks of 4
PROMPTS = [PROMPT, SHARED + [7, 8, 9], SHARED + [10, 11]]
MAX_NEW = 32


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_hf_model(CONFIGS[request.param](), seed=3).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, hf


def test_each_layer_gets_its_family_window(checkpoint):
    family, folder, _ = checkpoint
    model = load_model(folder, dtype="float32", device="cpu")
    assert model.config.layer_windows == EXPECTED_WINDOWS[family]


def test_logits_match_transformers_through_chunks_and_decode(checkpoint):
    _, folder, hf = checkpoint
    model = load_model(folder, dtype="float32", device="cpu")
    runner = PagedRunner(model, num_blocks=64, block_size=4, seed=1)
    # chunks of 24 and 46 (each crossing windows), then single-token decode steps
    got = [runner.step({"a": PROMPT[:24]})["a"], runner.step({"a": PROMPT[24:]})["a"]]
    for token in (3, 250, 17):
        got.append(runner.step({"a": [token]})["a"])
    with torch.no_grad():
        expected = hf(torch.tensor([runner.tokens("a")])).logits[0]
    torch.testing.assert_close(torch.cat(got), expected, rtol=2e-5, atol=5e-5)


def test_greedy_tokens_match_transformers_with_chunked_prefill_and_prefix_caching(checkpoint):
    _, folder, hf = checkpoint
    expected = hf_generate_greedy(hf, PROMPTS, MAX_NEW)
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        block_size=4,
        scheduling="chunked_prefill",
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    second = llm.generate({"prompt_token_ids": PROMPTS[2]}, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in first + second] == expected
    assert second[0].num_cached_tokens >= len(SHARED) - 4
    # the windows' layers have KV groups of their own (only their windows' blocks kept)
    assert WINDOW in llm.engine.scheduler.kv_groups


def _smallest_cache(folder, max_model_len: int, chunk: int) -> int:
    """The fewest blocks of 4 the engine accepts for this model (its hybrid KV groups: a
    window group holds only its window and the chunk)."""
    cfg = load_model_config(folder)
    layout = kv_group_layout(cfg.layer_windows, cfg.num_layers, max_model_len)
    assert layout.is_hybrid
    return min_kv_blocks(
        max_model_len,
        block_size=4,
        scheduling="chunked_prefill",
        max_num_batched_tokens=chunk,
        kv_groups=list(layout.windows),
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_tokens_match_transformers_under_preemption(checkpoint, mode):
    # 40- and 36-token prompts (2+ windows) in the smallest cache that holds one full-length
    # sequence: the two do not fit together
    _, folder, hf = checkpoint
    prompts = [PROMPT[:40], SHARED[:36]]
    expected = hf_generate_greedy(hf, prompts, MAX_NEW)
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        block_size=4,
        preemption_mode=mode,
        num_gpu_blocks=_smallest_cache(folder, 76, 8),
        max_model_len=76,
        scheduling="chunked_prefill",
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == expected
    assert llm.engine.scheduler.get_stats()["num_preemptions"] > 0


def _engine_greedy(folder, tp: int, prompts) -> list[list[int]]:
    args = EngineArgs(
        model=str(folder),
        tensor_parallel_size=tp,
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    return engine_greedy(args, prompts, 16)


def test_two_tensor_parallel_ranks_generate_the_greedy_tokens_of_one(checkpoint):
    _, folder, _ = checkpoint
    prompts = [PROMPT[:48], SHARED[:40]]
    assert _engine_greedy(folder, 2, prompts) == _engine_greedy(folder, 1, prompts)
