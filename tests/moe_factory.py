"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral), saved by transformers' `save_pretrained` like `model_factory` saves the dense ones.

`save_tiny_moe_checkpoint(folder, family, ...)`: `family` is "qwen3_moe", "qwen2_moe" or
"mixtral"; overrides go to the transformers config (e.g. `num_experts_per_tok=8`,
`mlp_only_layers=[1]`). Router weights are drawn larger than the other matrices so that the
routing is decisive (no near-ties between the k-th and (k+1)-th expert that rounding could flip).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from model_factory import _COMMON, build_hf_model, save_tiny_tokenizer

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_moe_config(family: str, **overrides) -> PretrainedConfig:
    kwargs = dict(_COMMON, num_experts_per_tok=2)
    if family == "qwen3_moe":
        kwargs.update(head_dim=24, num_experts=8, moe_intermediate_size=40, norm_topk_prob=True)
        config_class = Qwen3MoeConfig
    elif family == "qwen2_moe":
        kwargs.update(
            num_experts=8,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=56,
            rope_theta=1000000.0,
        )
        config_class = Qwen2MoeConfig
    elif family == "mixtral":
        kwargs.update(num_local_experts=8, intermediate_size=48)
        config_class = MixtralConfig
    else:
        raise ValueError(f"unknown MoE family {family!r}; expected one of {MOE_FAMILIES}")
    kwargs.update(overrides)
    return config_class(**kwargs)


def sharpen_routers(model: torch.nn.Module, scale: float = 4.0) -> None:
    """Routers' weights times `scale`: decisive top-k choices."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(scale)


def build_hf_moe(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    model = build_hf_model(config, seed)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        # the 3-D expert tensors `[E, out, in]`: randomize_weights scaled them by `out`
        for param in model.parameters():
            if param.dim() == 3:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(noise / math.sqrt(param.shape[2]))
    sharpen_routers(model)
    return model.eval()


def save_tiny_moe_checkpoint(
    folder: str | Path, family: str, *, seed: int = 0, tokenizer: str | None = "json", **overrides
) -> Path:
    folder = Path(folder)
    model = build_hf_moe(tiny_moe_config(family, **overrides), seed)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        save_tiny_tokenizer(folder, tokenizer)
    return folder
