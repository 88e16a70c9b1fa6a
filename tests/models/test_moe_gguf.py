"""Mixtures of experts from GGUF files (llama.cpp's `qwen3moe`, `qwen2moe`), written here with the
`gguf` package from tiny random transformers checkpoints, experts in Q8_0: the metadata as the
MoE config, each expert loaded as its own quantized weight (the file's bytes, undequantized), and
32 greedy tokens equal to transformers loading the same file.

transformers 5 cannot read a Qwen-MoE GGUF file's expert width (`expert_feed_forward_length` is
not in its key map), so it is handed the checkpoint's config; the weights are the file's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm.checkpoint.gguf_reader import open_gguf
from pagedllm.config import EngineArgs
from pagedllm.distributed.layers import TPShard
from pagedllm.models import load_model
from pagedllm.models.gguf import GGUFError, read_gguf_config

from engine_util import engine_greedy
from model_factory import hf_generate_greedy, paged_greedy
from moe_factory import save_tiny_moe_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0
# expert widths on Q8_0's 32-element blocks (and apart from the hidden size, 64)
WIDTHS = dict(moe_intermediate_size=96)
# heads of 32: o_proj's input split over two ranks on Q8_0 blocks
SHARDABLE = dict(WIDTHS, head_dim=32)
PROMPTS = [[5, 17, 99, 3], list(range(20, 41)), [7] * 9 + [11, 12, 13]]
CASES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2),
    "qwen2_moe_shared_expert": dict(
        num_experts=8, num_experts_per_tok=4, shared_expert_intermediate_size=128
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_file(request, tmp_path_factory):
    family = "qwen2_moe" if request.param.startswith("qwen2") else "qwen3_moe"
    folder = tmp_path_factory.mktemp(request.param)
    return save_tiny_moe_gguf(folder, family, seed=3, **WIDTHS, **CASES[request.param])


def hf_from_gguf(path):
    config = AutoConfig.from_pretrained(path.parent)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    return model.eval()


def test_32_greedy_tokens_equal_transformers_on_the_same_file(gguf_file):
    expected = hf_generate_greedy(hf_from_gguf(gguf_file), PROMPTS, 32)
    model = load_model(gguf_file, dtype="float32", device="cpu", pack_for_cpu=True)
    for prompt, want in zip(PROMPTS, expected):
        assert paged_greedy(model, prompt, 32) == want, f"prompt {prompt[:6]}..."


def test_each_expert_loads_as_its_own_weight_of_the_files_bytes(tmp_path):
    path = save_tiny_moe_gguf(tmp_path, "qwen3_moe", **WIDTHS)
    model = load_model(path, dtype="float32", device="cpu", pack_for_cpu=True)
    experts = model.model.layers[1].mlp.experts
    gate_ups, downs = experts.quant.gate_up, experts.quant.down
    assert len(gate_ups) == len(downs) == 8
    assert experts.gate_up_proj.numel() == experts.down_proj.numel() == 0
    tensors = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.1.mlp.experts.5."
    gate_up = gate_ups[5]
    assert [s.qtype for s in gate_up.segments] == [Q8_0, Q8_0]
    for segment, proj in zip(gate_up.segments, ("gate", "up")):
        want = gguf.quants.quantize(tensors[f"{prefix}{proj}_proj.weight"].numpy(), Q8_0)
        np.testing.assert_array_equal(segment.data.numpy(), want)
    want = gguf.quants.quantize(tensors[f"{prefix}down_proj.weight"].numpy(), Q8_0)
    np.testing.assert_array_equal(downs[5].segments[0].data.numpy(), want)
    # the file's mapped bytes as they are, still in the file's type (nothing dequantized, nothing
    # copied: processes mapping the file share its page cache); the kernel borrows the runs of
    # memory of the layer's three stacked tensors, not three arrays per expert
    file = open_gguf(path)
    stored = [file.tensors[f"blk.1.ffn_{p}_exps.weight"].data for p in ("gate", "up", "down")]
    assert np.shares_memory(downs[5].segments[0].data.numpy(), stored[2])
    assert 1 <= len(experts.quant.buffers) <= 3
    for buffer in experts.quant.buffers:
        assert any(np.shares_memory(buffer, s) for s in stored)


@pytest.mark.parametrize(
    ("family", "arch", "normalized", "shared"),
    [
        ("qwen3_moe", "Qwen3MoeForCausalLM", True, 0),
        ("qwen2_moe", "Qwen2MoeForCausalLM", False, 64),
    ],
)
def test_the_metadata_becomes_the_moe_config(tmp_path, family, arch, normalized, shared):
    widths = dict(WIDTHS, shared_expert_intermediate_size=64) if shared else WIDTHS
    path = save_tiny_moe_gguf(tmp_path, family, num_experts=12, num_experts_per_tok=3, **widths)
    cfg = read_gguf_config(path)
    assert cfg.architecture == arch
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (12, 3, 96)
    # llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's (not in the file)
    assert moe.norm_topk_prob is normalized
    assert (moe.shared_expert_intermediate_size, moe.sparse_layers) == (shared, (0, 1))


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"qwen3moe.expert_used_count": 9}, r"'qwen3moe.expert_used_count' \(9\) exceeds"),
        ({"qwen3moe.expert_feed_forward_length": None}, "'qwen3moe.expert_feed_forward_length'"),
        ({"qwen3moe.expert_gating_func": 2}, "'qwen3moe.expert_gating_func' = 2 is not supported"),
    ],
    ids=["top_k_above_experts", "no_expert_width", "sigmoid_gating"],
)
def test_metadata_the_moe_block_cannot_run_is_a_clear_error(tmp_path, metadata, message):
    path = save_tiny_moe_gguf(tmp_path, "qwen3_moe", metadata=metadata, **WIDTHS)
    with pytest.raises(GGUFError, match=message):
        read_gguf_config(path)


def test_an_expert_parallel_rank_loads_its_share_of_the_quantized_experts(tmp_path):
    path = save_tiny_moe_gguf(tmp_path, "qwen3_moe", **SHARDABLE)
    whole = load_model(path, dtype="float32", device="cpu").model.layers[0].mlp.experts
    half = load_model(path, dtype="float32", device="cpu", tp=TPShard(1, 2, True))
    experts = half.model.layers[0].mlp.experts
    assert (experts.first, experts.num_experts, len(experts.quant.gate_up)) == (4, 4, 4)
    pairs = ((experts.quant.gate_up, whole.quant.gate_up), (experts.quant.down, whole.quant.down))
    for local, expert in enumerate(range(4, 8)):
        for mine, theirs in pairs:
            pairs = zip(mine[local].segments, theirs[expert].segments, strict=True)
            assert all(torch.equal(a.data, b.data) for a, b in pairs)


def _greedy_engine(path, tp: int, expert_parallel: bool) -> list[list[int]]:
    args = EngineArgs(
        model=str(path),
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        max_model_len=64,
        skip_tokenizer_init=True,
    )
    return engine_greedy(args, PROMPTS, 8)


def test_two_expert_parallel_ranks_on_quantized_experts_generate_the_tokens_of_one(tmp_path):
    path = save_tiny_moe_gguf(tmp_path, "qwen3_moe", seed=5, **SHARDABLE)
    assert _greedy_engine(path, 2, True) == _greedy_engine(path, 1, False)


def test_a_mixtral_file_llama_with_experts_generates_the_greedy_tokens_of_its_checkpoint(
    tmp_path,
):
    # F32: the file's weights are the checkpoint's (Q and K permuted as llama.cpp stores them)
    path = save_tiny_moe_gguf(tmp_path, "mixtral", qtype=gguf.GGMLQuantizationType.F32, seed=3)
    cfg = read_gguf_config(path)
    assert (cfg.architecture, cfg.moe.naming, cfg.moe.num_experts, cfg.moe.top_k) == (
        "MixtralForCausalLM",
        "mixtral",
        8,
        2,
    )
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = hf_generate_greedy(hf, PROMPTS, 32)
    model = load_model(path, dtype="float32", device="cpu", pack_for_cpu=True)
    for prompt, want in zip(PROMPTS, expected):
        assert paged_greedy(model, prompt, 32) == want, f"prompt {prompt[:6]}..."


def test_the_workers_weight_move_puts_the_experts_in_their_own_buffer_with_the_same_tokens(
    tmp_path, monkeypatch
):
    from pagedllm.worker import weight_pages

    path = save_tiny_moe_gguf(tmp_path, "qwen3_moe", **WIDTHS)
    model = load_model(path, dtype="float32", device="cpu", pack_for_cpu=True)
    want = paged_greedy(model, PROMPTS[0], 8)
    experts = model.model.layers[1].mlp.experts
    before = experts.quant
    monkeypatch.setattr(weight_pages, "HUGE_PAGE_BYTES", 0)  # the tiny experts are moved too
    moved = weight_pages.move_weights(model)
    assert moved >= before.nbytes and experts.quant is not before
    assert len(experts.quant.buffers) == 1
    assert not any(np.shares_memory(experts.quant.buffers[0], b) for b in before.buffers)
    assert paged_greedy(model, PROMPTS[0], 8) == want
