"""What LoRA can adapt in our decoder (`ModelLoRASpec`) and one loaded adapter (`LoRAAdapter`).

The decoder fuses q/k/v and gate/up into one projection each (`FusedLinear`); an adapter is
still written per checkpoint projection (PEFT's `q_proj`, `gate_proj`, ...), and each lands in
its projection's columns of the fused output.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from pagedllm.models.config import ModelConfig

# our fused layer -> the checkpoint projections it holds, in column order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PROJECTIONS: tuple[str, ...] = tuple(p for parts in FUSED_PARTS.values() for p in parts)


@dataclass(frozen=True)
class ModelLoRASpec:
    """The adaptable projections of a model: (in_features, out_features) of each, per layer."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelLoRASpec:
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        return cls(
            num_layers=cfg.num_layers,
            shapes={
                "q_proj": (h, q),
                "k_proj": (h, kv),
                "v_proj": (h, kv),
                "o_proj": (q, h),
                "gate_proj": (h, inter),
                "up_proj": (h, inter),
                "down_proj": (inter, h),
            },
        )


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: per (layer, projection), `A [r, in]` and `B [out, r]`
    with the PEFT scaling (`lora_alpha / r`, or `/ sqrt(r)` under rsLoRA) folded into B."""

    name: str
    lora_int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}
