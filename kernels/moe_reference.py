"""The mixture-of-experts products in torch: the reference of the grouped CPU kernel
(`kernels/cpu_moe.py`) and the path everywhere it does not run (GPU, float16).

transformers' loop: for each expert some token chose (ascending), its tokens' rows through
gate/up, `silu(gate) * up`, down, scaled by the router's weight, added into the output. Experts no
token chose are never touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def moe_experts_reference(
    x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor
) -> Tensor:
    """x `[T, H]`, gate_up `[E, 2I, H]` (gate rows then up rows), down `[E, H, I]`, the
    router's weights `[T, k]` (float32) and expert ids `[T, k]` -> `[T, H]` in x's dtype; a
    negative id (`cpu_moe.NOT_HELD`: another rank's expert) adds nothing."""
    out = torch.zeros_like(x)
    width = down.shape[-1]
    for expert in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = torch.where(ids == expert)
        h = F.linear(x[tokens], gate_up[expert])
        act = F.silu(h[:, :width]) * h[:, width:]
        y = F.linear(act, down[expert]) * weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
