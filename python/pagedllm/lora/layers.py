"""LoRA-aware projections: each adaptable projection of the decoder is wrapped once, when LoRA
is enabled, by a module that runs the base projection and then adds the step's LoRA deltas to
its output columns (vLLM does the same with its merged column-parallel layers).

A step whose rows have no adapter (`LoRAState.segments is None`) runs the base projection only.
Under tensor parallelism the slots hold this rank's shard (see `slots.py`); a row-parallel
projection's delta is added to this rank's partial output, before the all-reduce that sums both.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from pagedllm.distributed.layers import RowParallelLinear
from pagedllm.kernels import lora_reference
from pagedllm.kernels.lora_reference import LoRASegments
from pagedllm.lora.adapter import FUSED_PARTS
from pagedllm.lora.slots import LoRASlots


@dataclass
class LoRAState:
    """What every wrapped projection reads in a forward: the slots' weights and this step's
    token segments (set by `LoRAManager.prepare_step` before the forward)."""

    slots: LoRASlots
    segments: LoRASegments | None = None

    def ops(self, x: Tensor):
        """(shrink, expand): the Triton kernels on CUDA, the torch reference elsewhere."""
        if x.is_cuda:
            from pagedllm.kernels import lora_expand, lora_shrink

            return lora_shrink, lora_expand
        return lora_reference.lora_shrink, lora_reference.lora_expand


class LoRALinear(nn.Module):
    """`base` (an `nn.Linear` or a `FusedLinear`) plus the LoRA deltas of its parts."""

    def __init__(self, base: nn.Linear, fused: str, layer: int, state: LoRAState) -> None:
        super().__init__()
        self.base_layer = base
        self.fused, self.layer, self.state = fused, layer, state
        parts = FUSED_PARTS[fused]
        slices = getattr(base, "output_slices", None)
        if slices is None:
            starts = [0]
        else:
            # FusedLinear names its parts "q"/"k"/"v", "gate"/"up": the projection minus "_proj"
            starts = [slices[part.removesuffix("_proj")].start for part in parts]
        self.parts = tuple(zip(parts, starts))

    def forward(self, x: Tensor) -> Tensor:
        seg = self.state.segments
        if seg is None:
            return self.base_layer(x)
        row_parallel = isinstance(self.base_layer, RowParallelLinear)
        out = self.base_layer.partial(x) if row_parallel else self.base_layer(x)
        slots = self.state.slots
        shrink, expand = self.state.ops(x)
        y = shrink(x, slots.a[self.fused][self.layer], seg)
        for j, (part, start) in enumerate(self.parts):
            expand(y, slots.b[part][self.layer], seg, out, j * slots.rank, start)
        return self.base_layer.reduce(out) if row_parallel else out

    # the decoder reads a fused projection's parts through these
    def split(self, out: Tensor) -> tuple[Tensor, ...]:
        return self.base_layer.split(out)

    def part(self, out: Tensor, name: str) -> Tensor:
        return self.base_layer.part(out, name)


def wrap_projections(model: nn.Module, state: LoRAState) -> None:
    """Replace every adaptable projection of `model` (a `DecoderForCausalLM`) by its
    `LoRALinear`."""
    for i, layer in enumerate(model.model.layers):
        for owner, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            base = getattr(owner, name)
            if isinstance(base, LoRALinear):
                raise ValueError("the model's projections are already LoRA-wrapped")
            setattr(owner, name, LoRALinear(base, name, i, state))
