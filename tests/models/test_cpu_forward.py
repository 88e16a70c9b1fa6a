"""The fused CPU forward (models/cpu_forward.py, `_core.CpuDecoder`): the decoder's layers in one
Rust call a step give exactly the layer-by-layer path's numbers, and are used only where the
model qualifies."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.kernels import cpu_quant
from pagedllm.models import cpu_forward

from model_factory import save_tiny_checkpoint

PROMPTS = [
    [5, 9, 33, 71, 2, 8, 100, 41, 17, 3, 64, 12, 90, 7],
    [11, 12, 13],
    [200, 150, 100, 50, 25, 12, 6, 3, 1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 121, 144],
]
PARAMS = SamplingParams(
    max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2
)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    # whole 32-value blocks, so that the quantized variant applies too
    folder = tmp_path_factory.mktemp(request.param) / "m"
    return save_tiny_checkpoint(folder, request.param, hidden_size=64, intermediate_size=128)


def tokens_and_logprobs(engine_pair, folder, *, fused: bool, **engine) -> tuple[list, list, list]:
    """Tokens and logprobs of PROMPTS by `engine_pair`'s engine, and what `build` returned."""
    engine.setdefault("enable_prefix_caching", True)
    _, outputs, built = engine_pair(folder, PROMPTS, PARAMS, fused=fused, **engine)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [(o.prompt_logprobs, o.outputs[0].logprobs) for o in outputs]
    return tokens, logprobs, built


@pytest.fixture
def generate(engine_pair):
    return functools.partial(tokens_and_logprobs, engine_pair)


def _logprob_values(logprobs) -> list:
    # every (token, logprob) of every position, exactly as floats
    values = []
    for prompt, sampled in logprobs:
        for position in [*(prompt or []), *sampled]:
            if position is None:
                continue
            values.append(sorted((t, lp.logprob) for t, lp in position.items()))
    return values


def test_fused_forward_gives_the_layer_by_layer_numbers_exactly(generate, checkpoint):
    fused_tokens, fused_logprobs, built = generate(checkpoint, fused=True)
    assert built and built[0] is not None  # the fused path did run
    tokens, logprobs, _ = generate(checkpoint, fused=False)
    assert fused_tokens == tokens
    assert _logprob_values(fused_logprobs) == _logprob_values(logprobs)


@pytest.mark.parametrize("activations", cpu_quant.ACTIVATION_CHOICES)
def test_fused_forward_gives_the_same_numbers_on_quantized_weights(
    monkeypatch, generate, tmp_path, activations
):
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    monkeypatch.setattr(cpu_quant, "ACTIVATIONS", activations)
    fused, fused_logprobs, built = generate(folder, fused=True, quantization="q4_0")
    assert built[0] is not None
    tokens, logprobs, _ = generate(folder, fused=False, quantization="q4_0")
    assert fused == tokens
    assert _logprob_values(fused_logprobs) == _logprob_values(logprobs)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_fused_forward_over_a_quantized_kv_cache_gives_the_layer_by_layer_numbers(
    generate, tmp_path, kv_cache_dtype
):
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    kv = {"kv_cache_dtype": kv_cache_dtype}
    fused_tokens, fused_logprobs, built = generate(folder, fused=True, **kv)
    assert built[0] is not None
    tokens, logprobs, _ = generate(folder, fused=False, **kv)
    assert fused_tokens == tokens
    assert _logprob_values(fused_logprobs) == _logprob_values(logprobs)


def test_fused_forward_of_a_bfloat16_model_gives_the_layer_by_layer_numbers_exactly(
    generate, checkpoint
):
    engine = {"dtype": "bfloat16"}
    fused_tokens, fused_logprobs, built = generate(checkpoint, fused=True, **engine)
    assert built and built[0] is not None  # the fused path did run
    tokens, logprobs, _ = generate(checkpoint, fused=False, **engine)
    assert fused_tokens == tokens
    assert _logprob_values(fused_logprobs) == _logprob_values(logprobs)


@pytest.mark.parametrize(
    "engine",
    [
        {"enable_lora": True},
        # a quantized cache's key transform is applied in float32 only
        {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
    ],
    ids=["lora", "bfloat16_int8_cache"],
)
def test_models_that_do_not_qualify_run_layer_by_layer(generate, tmp_path, engine):
    folder = save_tiny_checkpoint(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    _, _, built = generate(folder, fused=True, **engine)
    assert built == [None]


def _decoder(num_layers: int = 1, hidden: int = 64) -> tuple:
    norm = np.ones(hidden, dtype=np.float32)
    panels = lambda n, k: ("panels", np.zeros((-(-n // 16), k, 16), np.float32), n, None)  # noqa: E731
    layer = (
        norm,
        panels(3 * hidden, hidden),
        None,
        None,
        panels(hidden, hidden),
        norm,
        panels(256, hidden),
        panels(hidden, 128),
    )
    return [layer] * num_layers, norm


def test_a_layer_of_the_wrong_shape_is_a_value_error_naming_it():
    layers, norm = _decoder(2)
    bad = list(layers[1])
    bad[4] = ("panels", np.zeros((4, 32, 16), np.float32), 64, None)  # o takes 32 inputs
    from pagedllm import _core

    decoder = _core.CpuDecoder([layers[0], tuple(bad)], norm, 1, 1, 64, 1e-6, 0.125)
    x = np.zeros((1, 64), np.float32)
    tables = np.zeros((1, 32), np.float32)
    cache = np.zeros((2, 2, 4, 16, 1, 64), np.float32)
    with pytest.raises(ValueError, match="layer 1: o is"):
        decoder.forward(
            x,
            tables,
            tables,
            np.zeros(1, np.int64),
            np.array([0, 1], np.int32),
            np.array([1], np.int32),
            np.zeros((1, 1), np.int32),
            cache,
            1,
        )


def test_a_layer_spec_of_the_wrong_kind_is_a_value_error_naming_it():
    from pagedllm import _core

    layers, norm = _decoder(1)
    bad = list(layers[0])
    bad[1] = ("dense", bad[1][1], 192, None)
    with pytest.raises(ValueError, match='layer 0\'s qkv: kind "dense"'):
        _core.CpuDecoder([tuple(bad)], norm, 1, 1, 64, 1e-6, 0.125)


def test_a_kv_cache_for_other_layers_is_a_value_error():
    from pagedllm import _core

    layers, norm = _decoder(2)
    decoder = _core.CpuDecoder(layers, norm, 1, 1, 64, 1e-6, 0.125)
    tables = np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError, match="kv_cache has shape"):
        decoder.forward(
            np.zeros((1, 64), np.float32),
            tables,
            tables,
            np.zeros(1, np.int64),
            np.array([0, 1], np.int32),
            np.array([1], np.int32),
            np.zeros((1, 1), np.int32),
            np.zeros((2, 3, 4, 16, 1, 64), np.float32),
            1,
        )


def test_a_kv_cache_not_of_its_kv_cache_dtype_is_a_type_error_naming_both():
    from pagedllm import _core

    layers, norm = _decoder(2)
    decoder = _core.CpuDecoder(layers, norm, 1, 1, 64, 1e-6, 0.125)
    tables = np.zeros((1, 32), np.float32)
    step = (
        np.zeros((1, 64), np.float32),
        tables,
        tables,
        np.zeros(1, np.int64),
        np.array([0, 1], np.int32),
        np.array([1], np.int32),
        np.zeros((1, 1), np.int32),
    )
    float_cache = np.zeros((2, 2, 4, 16, 1, 64), np.float32)
    with pytest.raises(TypeError, match=r"kv_cache must be a 6-D int8 \(kv_cache_dtype int8\)"):
        decoder.forward(*step, float_cache, 1, "f32", "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        decoder.forward(*step, float_cache, 1, "f32", "int4")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_sliding_window_and_gemma_models_run_layer_by_layer(tmp_path, family):
    from test_sliding_window_models import CONFIGS

    from pagedllm.models import load_model

    from model_factory import build_hf_model

    build_hf_model(CONFIGS[family](), seed=3).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype="float32", device="cpu", pack_for_cpu=True)
    cfg = model.config
    kv_cache = torch.zeros(2, cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim)
    assert cpu_forward.build(model, kv_cache, lora=False) is None


def test_a_plain_model_is_fused(checkpoint):
    from pagedllm.models import load_model

    model = load_model(checkpoint, dtype="float32", device="cpu", pack_for_cpu=True)
    cfg = model.config
    kv_cache = torch.zeros(2, cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim)
    assert cpu_forward.build(model, kv_cache, lora=False) is not None
    assert cpu_forward.build(model, kv_cache, lora=True) is None


def test_a_plain_model_is_fused_from_its_token_ids_to_its_logits(checkpoint):
    from pagedllm.models import load_model

    model = load_model(checkpoint, dtype="float32", device="cpu", pack_for_cpu=True)
    cfg = model.config
    kv_cache = torch.zeros(2, cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim)
    assert cpu_forward.build(model, kv_cache, lora=False).head_rows == cfg.vocab_size


def _step_arrays() -> tuple:
    tables = np.zeros((1, 32), np.float32)
    return (
        tables,
        tables,
        np.zeros(1, np.int64),
        np.array([0, 1], np.int32),
        np.array([1], np.int32),
        np.zeros((1, 1), np.int32),
        np.zeros((2, 1, 4, 16, 1, 64), np.float32),
    )


def test_logits_of_a_decoder_without_its_embedding_and_head_is_a_value_error():
    from pagedllm import _core

    layers, norm = _decoder(1)
    decoder = _core.CpuDecoder(layers, norm, 1, 1, 64, 1e-6, 0.125)
    ids, rows, logits = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, 16), np.float32)
    with pytest.raises(ValueError, match="holds no embedding and LM head"):
        decoder.logits(ids, *_step_arrays(), rows, logits, 1)


@pytest.mark.parametrize(
    ("ids", "rows", "message"),
    [([16], [0], "token id 16 is outside"), ([3], [1], "sample row 1 is outside")],
    ids=["token", "row"],
)
def test_a_token_id_or_sample_row_out_of_range_is_a_value_error(ids, rows, message):
    from pagedllm import _core

    layers, norm = _decoder(1)
    table = np.zeros((16, 64), np.float32)
    head = ("panels", np.zeros((1, 64, 16), np.float32), 16, None)
    decoder = _core.CpuDecoder(layers, norm, 1, 1, 64, 1e-6, 0.125, ends=(("table", table), head))
    ids, rows = np.array(ids, np.int64), np.array(rows, np.int64)
    with pytest.raises(ValueError, match=message):
        decoder.logits(ids, *_step_arrays(), rows, np.zeros((1, 16), np.float32), 1)
