"""The fused CPU forward (`_core.CpuDecoder`) with a quantized cache's key transform
(`attention/key_transform.py`): the layer-by-layer path's numbers exactly, and a transform of
the wrong size refused naming it."""

from __future__ import annotations

import numpy as np
import pytest
from test_cpu_forward import _logprob_values, tokens_and_logprobs

from pagedllm import _core

from model_factory import save_tiny_checkpoint


@pytest.mark.parametrize(("family", "kv_cache_dtype"), [("llama", "int8"), ("qwen3", "fp8_e4m3")])
def test_fused_forward_with_a_key_transform_gives_the_layer_by_layer_numbers(
    engine_pair, tmp_path, family, kv_cache_dtype
):
    # qwen3: q/k norms before the rotation (the transform on their own buffers)
    folder = save_tiny_checkpoint(tmp_path / "m", family, hidden_size=64, intermediate_size=128)
    kv = {"kv_cache_dtype": kv_cache_dtype}
    fused_tokens, fused_logprobs, built = tokens_and_logprobs(engine_pair, folder, fused=True, **kv)
    decoder = built[0]
    assert decoder is not None
    transforms = [layer.self_attn.key_transform for layer in decoder.model.model.layers]
    assert all(t is not None for t in transforms)  # calibrated (a quantized cache)
    tokens, logprobs, _ = tokens_and_logprobs(engine_pair, folder, fused=False, **kv)
    assert fused_tokens == tokens
    assert _logprob_values(fused_logprobs) == _logprob_values(logprobs)


def test_a_key_transform_of_the_wrong_size_is_a_value_error_naming_it():
    hidden, heads, kv_heads, d = 64, 4, 2, 16
    norm = np.ones(hidden, dtype=np.float32)
    panels = lambda n, k: ("panels", np.zeros((-(-n // 16), k, 16), np.float32), n, None)  # noqa: E731
    layer = (
        norm,
        panels((heads + 2 * kv_heads) * d, hidden),
        None,
        None,
        panels(hidden, heads * d),
        norm,
        panels(256, hidden),
        panels(hidden, 128),
    )
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    transform = (ones(heads * d), ones(kv_heads * d), ones(kv_heads * d - 1), None)
    decoder = _core.CpuDecoder(
        [layer], norm, heads, kv_heads, d, 1e-6, 0.25, key_transforms=[transform]
    )
    x = np.zeros((1, hidden), dtype=np.float32)
    cos = np.ones((1, d // 2), dtype=np.float32)
    kv = np.zeros((2, 1, 1, 4, kv_heads, d), dtype=np.float32)
    with pytest.raises(ValueError, match="key transform"):
        decoder.forward(
            x,
            cos,
            cos * 0,
            np.zeros(1, np.int64),
            np.array([0, 1], np.int32),
            np.array([1], np.int32),
            np.zeros((1, 1), np.int32),
            kv,
            1,
        )
