"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against
transformers, float32 on CPU: logits of a packed prefill, decode steps and a chunk over the paged
cache within the dense families' tolerance; 32 greedy tokens on several prompts equal to
transformers' `generate`; routing corner cases (experts no token chose, one expert every token
chose) on the grouped kernel and the torch loop."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pagedllm.models import load_model
from pagedllm.models.moe import SparseMoeBlock, expert_token_counts

from model_factory import PagedRunner, hf_generate_greedy, paged_greedy
from moe_factory import save_tiny_moe_checkpoint

TOLERANCE = dict(rtol=2e-5, atol=2e-5)  # the dense families' (test_models_parity)
PROMPTS = {"a": [5, 17, 99, 3, 250, 7, 8, 42, 11, 64, 300], "b": [2, 210, 33, 4, 19]}
CHUNKS = {"a": [12, 13, 14, 15, 16, 17], "b": [101, 102, 103]}
GREEDY_PROMPTS = [[5, 17, 99, 3], list(range(20, 41)), [7] * 9 + [11, 12, 13]]
# (family, config overrides): 8-16 experts, top-2 to top-8, dense layers among sparse ones
CASES = {
    "qwen3_moe_top2": ("qwen3_moe", {}),
    "qwen3_moe_top8_of_16_dense_layer": (
        "qwen3_moe",
        dict(num_experts=16, num_experts_per_tok=8, num_hidden_layers=3, mlp_only_layers=[1]),
    ),
    "qwen3_moe_sparse_step_2_unnormalized": (
        "qwen3_moe",
        dict(
            num_experts_per_tok=4, num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False
        ),
    ),
    "qwen2_moe_shared_expert": ("qwen2_moe", dict(num_experts=12, num_experts_per_tok=4)),
    "mixtral_top2": ("mixtral", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return save_tiny_moe_checkpoint(folder, family, seed=3, **overrides)


def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_step_matches(hf, runner: PagedRunner, step_logits) -> None:
    for name, logits in step_logits.items():
        tokens = runner.tokens(name)
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0].float()
        torch.testing.assert_close(logits, expected[len(tokens) - logits.shape[0] :], **TOLERANCE)


@pytest.mark.parametrize("pack_for_cpu", [True, False], ids=["grouped_kernel", "torch_loop"])
def test_logits_match_transformers_through_prefill_decode_and_chunk(checkpoint, pack_for_cpu):
    hf = hf_model(checkpoint)
    model = load_model(checkpoint, dtype="float32", device="cpu", pack_for_cpu=pack_for_cpu)
    runner = PagedRunner(model, num_blocks=32, block_size=4, seed=1)
    assert_step_matches(hf, runner, runner.step(PROMPTS))
    for step in range(3):
        assert_step_matches(hf, runner, runner.step({"a": [20 + step], "b": [30 + step]}))
    assert_step_matches(hf, runner, runner.step(CHUNKS))


def test_32_greedy_tokens_equal_transformers_on_several_prompts(checkpoint):
    expected = hf_generate_greedy(hf_model(checkpoint), GREEDY_PROMPTS, 32)
    model = load_model(checkpoint, dtype="float32", device="cpu", pack_for_cpu=True)
    for prompt, want in zip(GREEDY_PROMPTS, expected):
        assert paged_greedy(model, prompt, 32) == want, f"prompt {prompt[:6]}..."


def test_dense_layers_among_sparse_ones_follow_mlp_only_layers_and_the_sparse_step(tmp_path):
    folder = save_tiny_moe_checkpoint(
        tmp_path, "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    model = load_model(folder, dtype="float32", device="cpu")
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    # (i + 1) % 2 == 0 -> layers 1 and 3; layer 3 is listed as dense
    assert sparse == [False, True, False, False]


def test_a_batch_where_most_experts_get_no_token_is_correct_and_counted(tmp_path):
    # 16 experts, top-2, one 3-token prompt: at most 6 experts per layer take a token
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen3_moe", num_experts=16, seed=5)
    hf = hf_model(folder)
    model = load_model(folder, dtype="float32", device="cpu", pack_for_cpu=True)
    runner = PagedRunner(model, num_blocks=8, block_size=4)
    assert_step_matches(hf, runner, runner.step({"s": [9, 40, 77]}))
    for counts in expert_token_counts(model).values():
        assert sum(counts) == 3 * 2
        assert counts.count(0) >= 10


def zero_routers(folder) -> None:
    """Every router weight zero: all logits tie, and every token picks the same top-k experts
    (torch.topk's order of ties, the same in transformers and here)."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("pack_for_cpu", [True, False], ids=["grouped_kernel", "torch_loop"])
def test_a_batch_where_one_expert_gets_every_token_is_correct(tmp_path, pack_for_cpu):
    folder = save_tiny_moe_checkpoint(tmp_path, "mixtral", seed=6)
    zero_routers(folder)
    hf = hf_model(folder)
    model = load_model(folder, dtype="float32", device="cpu", pack_for_cpu=pack_for_cpu)
    runner = PagedRunner(model, num_blocks=32, block_size=4, seed=2)
    assert_step_matches(hf, runner, runner.step(PROMPTS))
    tokens = len(PROMPTS["a"]) + len(PROMPTS["b"])
    for counts in expert_token_counts(model).values():
        assert sorted(counts, reverse=True)[:2] == [tokens, tokens]
