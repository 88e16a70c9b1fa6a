"""Greedy token ids equal transformers' greedy `generate` (the outside oracle), end to end
through the engine: every strategy, chunked prefill, preemption in both modes, prefix-cache hits,
and n > 1."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from model_factory import build_hf_model, hf_generate_greedy, save_tiny_checkpoint, tiny_hf_config

MAX_NEW = 10
# different lengths: shorter than a block, across block boundaries, several blocks
PROMPTS = [[5, 17, 99, 3], list(range(20, 41)), [7] * 9 + [11, 12, 13], list(range(100, 133))]
SHARED = list(range(60, 92))  # a 32-token common prefix: 8 full blocks of 4
PREFIX_PROMPTS = [SHARED + [1, 2, 3], SHARED + [4, 5], SHARED + [6, 7, 8, 9, 10]]


def hf_greedy(folder, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return hf_generate_greedy(model, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_checkpoint(request, tmp_path_factory):
    folder = save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    expected = hf_greedy(folder, PROMPTS + PREFIX_PROMPTS)
    return folder, dict(zip(map(tuple, PROMPTS + PREFIX_PROMPTS), expected))


def generate(folder, prompts, n=1, **engine_kwargs):
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4, **engine_kwargs)
    params = SamplingParams(n=n, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def assert_greedy_parity(outs, prompts, expected):
    for prompt, out in zip(prompts, outs):
        assert out.finished
        for completion in out.outputs:
            assert completion.token_ids == expected[tuple(prompt)], f"prompt {prompt[:6]}..."


def assert_all_blocks_free(llm):
    stats = llm.engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]


@pytest.mark.parametrize("scheduling", ["unified", "prefill_first", "chunked_prefill"])
def test_greedy_matches_transformers_under_each_strategy(family_checkpoint, scheduling):
    folder, expected = family_checkpoint
    llm, outs = generate(folder, PROMPTS, scheduling=scheduling)
    assert_greedy_parity(outs, PROMPTS, expected)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("scheduling", ["unified", "chunked_prefill"])
def test_greedy_matches_transformers_with_a_small_token_budget(family_checkpoint, scheduling):
    folder, expected = family_checkpoint
    llm, outs = generate(folder, PROMPTS, scheduling=scheduling, max_num_batched_tokens=8)
    assert_greedy_parity(outs, PROMPTS, expected)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_transformers_under_preemption(family_checkpoint, mode):
    folder, expected = family_checkpoint
    # 11 blocks of 4 hold one max-length sequence, not all four prompts at once
    llm, outs = generate(
        folder,
        PROMPTS,
        preemption_mode=mode,
        num_gpu_blocks=11,
        max_model_len=44,
        enable_prefix_caching=False,
    )
    assert_greedy_parity(outs, PROMPTS, expected)
    assert llm.engine.scheduler.get_stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_greedy_matches_transformers_with_prefix_cache_hits(family_checkpoint):
    folder, expected = family_checkpoint
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": PREFIX_PROMPTS[0]}, params, use_tqdm=False)
    rest = llm.generate(
        [{"prompt_token_ids": p} for p in PREFIX_PROMPTS[1:]], params, use_tqdm=False
    )
    assert_greedy_parity(first + rest, PREFIX_PROMPTS, expected)
    assert all(out.num_cached_tokens >= len(SHARED) for out in rest)
    assert llm.engine.scheduler.get_stats()["prefix_cache_hits"] > 0


def test_all_n_greedy_samples_equal_the_reference(family_checkpoint):
    folder, expected = family_checkpoint
    llm, outs = generate(folder, PROMPTS[:2], n=3)
    assert [len(out.outputs) for out in outs] == [3, 3]
    assert_greedy_parity(outs, PROMPTS[:2], expected)
    assert_all_blocks_free(llm)


def test_n_greedy_samples_survive_preemption(family_checkpoint):
    folder, expected = family_checkpoint
    # 16 blocks hold the largest group (two 43-token sequences sharing 8 blocks), not all four
    llm, outs = generate(folder, PROMPTS, n=2, num_gpu_blocks=16, max_model_len=44)
    assert llm.engine.scheduler.get_stats()["num_preemptions"] > 0
    assert_greedy_parity(outs, PROMPTS, expected)
    assert_all_blocks_free(llm)


def test_default_model_greedy_matches_its_transformers_export():
    from pagedllm.models.hf_export import to_transformers

    llm = LLM(device="cpu", block_size=4)
    prompts = [list(b"Hello, my name is"), list(b"pagedllm")]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = to_transformers(llm.engine.model, llm.engine.model_config)
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_hf_config_factory_builds_each_family():
    # guards the fixture itself: a wrong family name would silently test llama three times
    assert {type(tiny_hf_config(f)).__name__ for f in ("llama", "qwen2", "qwen3")} == {
        "LlamaConfig",
        "Qwen2Config",
        "Qwen3Config",
    }
    assert build_hf_model(tiny_hf_config("qwen3")).config.head_dim == 24
