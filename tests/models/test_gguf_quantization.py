"""quantization="q8_0" | "q4_0" on a safetensors checkpoint: the linear layers are quantized at
load (`cpu_quant.quantize`) into the GGUF kernels, and run like their dequantized weights."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.models.loader import load_model

from model_factory import save_tiny_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # in_features 64 / 128: whole 32-value blocks
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "m", "llama", hidden_size=64, intermediate_size=128
    )


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_linears_are_quantized_and_match_their_dequantized_weights(folder, quantization):
    from pagedllm.kernels import cpu_quant

    dense = load_model(folder, device="cpu")
    quant = load_model(folder, device="cpu", quantization=quantization)
    layer, original = quant.model.layers[0].mlp.down_proj, dense.model.layers[0].mlp.down_proj
    assert layer.quant is not None and layer.weight.numel() == 0
    expected = cpu_quant.dequantize(
        cpu_quant.quantize(original.weight, {"q8_0": 8, "q4_0": 2}[quantization])
    )
    torch.testing.assert_close(quant.state_dict()["model.layers.0.mlp.down_proj.weight"], expected)
    x = torch.randn(2, original.in_features)
    torch.testing.assert_close(layer.forward(x), x @ expected.T, rtol=1e-4, atol=1e-4)
    # quantization error is small against the float weights
    assert (expected - original.weight).abs().max() < 0.1 * original.weight.abs().max()


def test_unknown_quantization_is_rejected_by_engine_args():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="q3_k")


def test_quantization_of_a_gguf_file_is_rejected(tmp_path):
    from test_gguf_loader import write_gguf

    write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="keep the types they are stored in"):
        load_model(tmp_path / "m.gguf", device="cpu", quantization="q8_0")
