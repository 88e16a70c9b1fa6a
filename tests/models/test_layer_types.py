"""Which layers slide and how far, read from config.json dicts (no weights): each family's rule,
`layer_types` when given, Gemma 3's two config dialects, and clear errors naming the field."""

from __future__ import annotations

import pytest

from pagedllm.checkpoint.errors import CheckpointError
from pagedllm.models.config import parse_model_config

SHAPES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)


def _parse(architecture: str, **fields):
    return parse_model_config({"architectures": [architecture], **SHAPES, **fields})


def test_mistral_slides_every_layer_with_4096_when_the_field_is_missing():
    assert _parse("MistralForCausalLM").layer_windows == (4096,) * 4


def test_mistral_with_an_explicit_null_window_is_full_attention():
    assert _parse("MistralForCausalLM", sliding_window=None).layer_windows == ()


def test_qwen2_slides_the_layers_from_max_window_layers_on():
    cfg = _parse(
        "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32, max_window_layers=2
    )
    assert cfg.layer_windows == (0, 0, 32, 32)


def test_qwen3_without_use_sliding_window_ignores_the_window():
    assert _parse("Qwen3ForCausalLM", sliding_window=32, max_window_layers=0).layer_windows == ()


def test_layer_types_decide_when_the_config_lists_them():
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    cfg = _parse("MistralForCausalLM", sliding_window=8, layer_types=types)
    assert cfg.layer_windows == (0, 8, 0, 8)


def test_an_unsupported_layer_type_names_the_field():
    types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(CheckpointError, match=r"'layer_types\[1\]' = 'chunked_attention'"):
        _parse("Gemma3ForCausalLM", layer_types=types)


def test_gemma2_alternates_local_and_global_layers_with_its_flags():
    cfg = _parse("Gemma2ForCausalLM", sliding_window=16, query_pre_attn_scalar=144)
    assert cfg.layer_windows == (16, 0, 16, 0)
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)  # transformers' defaults
    assert cfg.attention_scale == 144**-0.5 and cfg.embed_scale == 8.0
    assert cfg.tie_word_embeddings and cfg.norm_offset == 1.0 and cfg.head_dim == 256


def test_gemma3_older_config_reads_the_pattern_and_the_local_rope_base():
    cfg = _parse(
        "Gemma3ForCausalLM",
        num_hidden_layers=6,
        sliding_window=32,
        sliding_window_pattern=3,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=5000.0,
    )
    assert cfg.layer_windows == (32, 32, 0, 32, 32, 0)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)
    assert (cfg.local_rope.rope_type, cfg.local_rope.theta) == ("default", 5000.0)


def test_gemma3_nested_rope_parameters_give_each_layer_type_its_rope():
    cfg = _parse(
        "Gemma3ForCausalLM",
        sliding_window=32,
        rope_parameters={
            "full_attention": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 8192,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    assert (cfg.rope.rope_type, cfg.rope.theta) == ("yarn", 1e6)
    assert cfg.local_rope.theta == 10000.0


def test_an_unsupported_gemma3_rope_type_names_the_field():
    with pytest.raises(CheckpointError, match=r"rope_parameters\.rope_type' = 'proportional'"):
        _parse(
            "Gemma3ForCausalLM",
            rope_parameters={
                "full_attention": {"rope_type": "proportional", "factor": 2.0},
                "sliding_attention": {"rope_type": "default"},
            },
        )


def test_a_non_positive_window_names_the_field():
    with pytest.raises(CheckpointError, match="'sliding_window' must be a positive integer"):
        _parse("MistralForCausalLM", sliding_window=0)
