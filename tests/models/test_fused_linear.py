"""FusedLinear: one GEMM whose output columns are named projections."""

from __future__ import annotations

import torch

from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import Attention, GatedMLP
from pagedllm.models.fused_linear import FusedLinear
from pagedllm.models.tiny_random import tiny_random_config


def test_split_and_part_match_separate_projections():
    torch.manual_seed(0)
    sizes = {"q": 8, "k": 4, "v": 4}
    fused = FusedLinear(6, sizes, bias=True)
    x = torch.randn(3, 6)
    out = fused(x)
    start = 0
    for name, piece in zip(sizes, fused.split(out)):
        size = sizes[name]
        w, b = fused.weight[start : start + size], fused.bias[start : start + size]
        torch.testing.assert_close(piece, x @ w.T + b)
        assert fused.part(out, name).data_ptr() == piece.data_ptr()
        start += size


def test_slices_cover_the_output_in_order():
    fused = FusedLinear(4, {"gate": 5, "up": 5}, bias=False)
    assert fused.output_names == ("gate", "up")
    assert fused.output_slices == {"gate": slice(0, 5), "up": slice(5, 10)}
    assert fused.out_features == 10 and fused.bias is None


def test_decoder_projections_are_named():
    cfg: ModelConfig = tiny_random_config()
    attn, mlp = Attention(cfg), GatedMLP(cfg)
    assert attn.qkv_proj.output_names == ("q", "k", "v")
    assert attn.qkv_proj.output_sizes == (cfg.q_size, cfg.kv_size, cfg.kv_size)
    assert mlp.gate_up_proj.output_sizes == (cfg.intermediate_size, cfg.intermediate_size)
    # parameter names stay nn.Linear's: checkpoints and the loader see no change
    assert set(dict(attn.qkv_proj.named_parameters())) == {"weight"} | (
        {"bias"} if cfg.qkv_bias else set()
    )
