"""A mixture-of-experts config.json the MoE block cannot run is refused at load, naming the
field; the ones it runs parse to the routing transformers uses."""

from __future__ import annotations

import pytest

from pagedllm.models import CheckpointError
from pagedllm.models.config import parse_model_config

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)
QWEN3_MOE = dict(
    BASE,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


def test_more_experts_per_token_than_experts_is_refused_naming_the_field():
    with pytest.raises(CheckpointError, match="'num_experts_per_tok' \\(9\\) exceeds"):
        parse_model_config(dict(QWEN3_MOE, num_experts_per_tok=9))


def test_a_missing_moe_intermediate_size_is_refused_naming_the_field():
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(CheckpointError, match="missing required field 'moe_intermediate_size'"):
        parse_model_config(raw)


@pytest.mark.parametrize(
    ("field", "value"), [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")]
)
def test_an_unknown_routing_or_scoring_function_is_refused_naming_the_field(field, value):
    with pytest.raises(CheckpointError, match=f"field '{field}' = '{value}' is not supported"):
        parse_model_config(dict(QWEN3_MOE, **{field: value}))


def test_qwen2_moe_without_a_shared_expert_width_is_refused():
    raw = dict(QWEN3_MOE, architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(CheckpointError, match="'shared_expert_intermediate_size'"):
        parse_model_config(raw)


def test_mixtral_routes_every_layer_top_k_renormalized_over_its_mlp_width():
    raw = dict(
        BASE, architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2
    )
    moe = parse_model_config(raw).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 96)
    assert moe.norm_topk_prob and moe.sparse_layers == (0, 1, 2, 3)


def test_a_dense_architecture_has_no_moe():
    assert parse_model_config(dict(BASE, architectures=["Qwen3ForCausalLM"])).moe is None
