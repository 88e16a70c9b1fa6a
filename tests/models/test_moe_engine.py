"""A mixture of experts through the engine (Qwen2-MoE with its shared expert, and Qwen3-MoE with
a dense layer among sparse ones): greedy tokens equal to transformers under chunked prefill with
a small token budget, prefix-cache hits and recompute preemption; the per-expert token counts on
`get_stats()` and `/metrics`; LoRA refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams

from model_factory import hf_generate_greedy
from moe_factory import save_tiny_moe_checkpoint

MAX_NEW = 10
SHARED = list(range(60, 76))  # a 16-token common prefix: 4 full blocks of 4
PROMPTS = [[5, 17, 99, 3], list(range(20, 41)), SHARED + [1, 2, 3], SHARED + [4, 5]]
CASES = {
    "qwen2_moe": dict(num_experts=12, num_experts_per_tok=4),
    "qwen3_moe": dict(
        num_experts=16, num_experts_per_tok=8, num_hidden_layers=3, mlp_only_layers=[1]
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_moe_checkpoint(folder, request.param, seed=3, **CASES[request.param])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf_generate_greedy(hf, PROMPTS, MAX_NEW)
    return folder, expected


def generate(folder, prompts, **engine_kwargs):
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [out.outputs[0].token_ids for out in outs]


def test_greedy_matches_transformers_under_chunked_prefill_and_prefix_cache_hits(checkpoint):
    folder, expected = checkpoint
    llm, first = generate(
        folder, PROMPTS[:3], scheduling="chunked_prefill", max_num_batched_tokens=8
    )
    # the last prompt shares the third's cached prefix
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    (hit,) = llm.generate({"prompt_token_ids": PROMPTS[3]}, params, use_tqdm=False)
    assert first + [hit.outputs[0].token_ids] == expected
    assert hit.num_cached_tokens >= len(SHARED)


def test_greedy_matches_transformers_under_recompute_preemption(checkpoint):
    folder, expected = checkpoint
    # 9 blocks of 4 hold one max-length sequence, not all four prompts at once
    llm, tokens = generate(
        folder,
        PROMPTS,
        preemption_mode="recompute",
        num_gpu_blocks=9,
        max_model_len=36,
        enable_prefix_caching=False,
    )
    assert tokens == expected
    assert llm.engine.scheduler.get_stats()["num_preemptions"] > 0


def test_expert_token_counts_on_stats_and_metrics(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagedllm.entrypoints.metrics import _EngineCollector

    folder = save_tiny_moe_checkpoint(tmp_path, "mixtral", seed=4)
    llm, _ = generate(folder, PROMPTS[:2], enable_prefix_caching=False)
    per_layer = llm.engine.get_stats()["moe_expert_tokens"]
    assert list(per_layer) == [0, 1]
    # every prompt token and every generated token but the last runs once, top-2
    tokens = sum(len(p) for p in PROMPTS[:2]) + 2 * (MAX_NEW - 1)
    assert all(sum(counts) == 2 * tokens for counts in per_layer.values())

    class Snapshot:  # what the server's collector reads: the engine loop's latest stats
        stats = llm.engine.get_stats()

    class Server:
        engine, snapshot = llm.engine, Snapshot

    registry = CollectorRegistry()
    registry.register(_EngineCollector(Server))
    page = generate_latest(registry).decode()
    samples = {
        (s.labels["layer"], s.labels["expert"]): s.value
        for family in text_string_to_metric_families(page)
        if family.name == "pagedllm:moe_expert_tokens"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert samples[("1", "3")] == per_layer[1][3]
    assert len(samples) == 2 * 8


def test_lora_on_a_mixture_of_experts_is_refused_naming_it(tmp_path):
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen3_moe")
    with pytest.raises(
        ValueError, match="enable_lora: Qwen3MoeForCausalLM is a mixture of experts"
    ):
        LLM(str(folder), dtype="float32", device="cpu", enable_lora=True)
