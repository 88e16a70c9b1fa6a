"""`MoeConfig`: the mixture-of-experts fields of a Qwen3-MoE, Qwen2-MoE or Mixtral `config.json`.

Pure Python like `models/config.py`, so a config the MoE block cannot run (more experts per token
than experts, no expert width, a routing this block does not compute) is refused by name before
any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.checkpoint.errors import CheckpointError

# architecture -> how its checkpoint names the MoE tensors ("qwen": `mlp.experts.N.gate_proj`,
# "mixtral": `block_sparse_moe.experts.N.w1`)
MOE_NAMING = {
    "Qwen3MoeForCausalLM": "qwen",
    "Qwen2MoeForCausalLM": "qwen",
    "MixtralForCausalLM": "mixtral",
}
# the router's scores and its choice of experts: the only ones these families use
SUPPORTED_SCORING = ("softmax",)
SUPPORTED_TOPK_METHODS = ("greedy",)


@dataclass(frozen=True)
class MoeConfig:
    """Routing and shapes of the sparse MLP blocks."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # one expert's width
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1 (Mixtral: always)
    sparse_layers: tuple[int, ...]  # layers whose MLP is the MoE block; the others are dense
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    naming: str = "qwen"  # MOE_NAMING

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def parse_moe_config(
    raw: dict[str, Any], architecture: str, num_layers: int, source: Any
) -> MoeConfig | None:
    """The MoeConfig of an MoE architecture's config.json (None for a dense one);
    CheckpointError naming the field that does not fit."""
    naming = MOE_NAMING.get(architecture)
    if naming is None:
        return None
    _check_routing(raw, source)
    num_experts = _positive(
        raw, "num_local_experts" if "num_local_experts" in raw else "num_experts", source
    )
    top_k = _positive(raw, "num_experts_per_tok", source)
    if top_k > num_experts:
        raise CheckpointError(
            f"{source}: field 'num_experts_per_tok' ({top_k}) exceeds the number of experts "
            f"({num_experts})"
        )
    if naming == "mixtral":
        # Mixtral's experts are its MLP: softmax over the chosen logits, every layer sparse
        return MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=_positive(raw, "intermediate_size", source),
            norm_topk_prob=True,
            sparse_layers=tuple(range(num_layers)),
            naming=naming,
        )
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = _positive(raw, "shared_expert_intermediate_size", source)
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=_positive(raw, "moe_intermediate_size", source),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=_sparse_layers(raw, num_layers, source),
        shared_expert_intermediate_size=shared,
        naming=naming,
    )


def _check_routing(raw: dict[str, Any], source: Any) -> None:
    scoring = raw.get("scoring_func", "softmax")
    if scoring not in SUPPORTED_SCORING:
        raise CheckpointError(
            f"{source}: field 'scoring_func' = {scoring!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_SCORING)}"
        )
    method = raw.get("topk_method", "greedy")
    if method not in SUPPORTED_TOPK_METHODS:
        raise CheckpointError(
            f"{source}: field 'topk_method' = {method!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOPK_METHODS)}"
        )


def _sparse_layers(raw: dict[str, Any], num_layers: int, source: Any) -> tuple[int, ...]:
    # transformers' rule: layer i is sparse unless listed in `mlp_only_layers`, and only every
    # `decoder_sparse_step`-th layer (counting from 1) is
    step = _positive(raw, "decoder_sparse_step", source) if "decoder_sparse_step" in raw else 1
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise CheckpointError(f"{source}: field 'mlp_only_layers' must be a list of layer indexes")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _positive(raw: dict[str, Any], name: str, source: Any) -> int:
    if raw.get(name) is None:
        raise CheckpointError(f"{source}: missing required field '{name}' for a mixture of experts")
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: field '{name}' must be a positive integer, got {value!r}")
    return value
