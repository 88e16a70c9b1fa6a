"""The dense feed-forward block, shared by the decoder's layers and the MoE block's shared
expert (a module of its own so that neither imports the other for it)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm.distributed.layers import ColumnParallelLinear, RowParallelLinear, TPShard
from pagedllm.kernels.cpu_activation import silu_and_mul
from pagedllm.models.config import ModelConfig
from pagedllm.models.fused_linear import SINGLE


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused; Gemma's GeGLU
    (`hidden_act` gelu_pytorch_tanh) with gelu's tanh approximation instead of silu."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        sizes = {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, sizes, tp, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias
        )
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: Tensor) -> Tensor:
        # the fused output's columns are gate then up (the order of `sizes` above)
        gate_up = self.gate_up_proj.forward(x)
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj.forward(silu_and_mul(gate_up))
