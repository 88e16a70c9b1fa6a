"""The mixture-of-experts MLP block of Qwen3-MoE, Qwen2-MoE and Mixtral, beside the one decoder.

A router (a linear layer to one logit per expert) picks each token's top-k experts: softmax over
all logits in float32, the k largest kept, renormalized to sum to 1 when the config says so
(`norm_topk_prob`; Mixtral always, which is the softmax over the chosen logits) — transformers'
formula, step for step. Each chosen expert is a SwiGLU MLP; the token's output is the weighted sum
of its experts' outputs. Qwen2-MoE adds a shared expert that every token runs, scaled by a sigmoid
gate.

The experts' weights are held as two stacked parameters (`gate_up_proj` `[E * 2I, H]`: each
expert's gate rows then its up rows; `down_proj` `[E * H, I]`), the checkpoint's per-expert
tensors concatenated by the loader. On the CPU they are packed into per-expert panels
(`pack_experts`) and a step runs the grouped kernel (`kernels.cpu_moe`): tokens grouped by
expert, each chosen expert's weights read once for all its tokens, experts no token chose never
read. Elsewhere the torch loop (`kernels.moe_reference`). Experts loaded quantized from a GGUF
file (`set_quantized`: a `cpu_quant.QuantWeight` per expert and projection, in the file's type)
run the same grouping over the quantized products (`cpu_moe.moe_quant_experts`).

Tensor parallelism shards the experts like the dense MLP: rank r holds slice r of every expert's
intermediate width, the partial outputs (and the shared expert's) are summed by one all-reduce.
With expert parallelism (`enable_expert_parallel`, `TPShard.expert_parallel`) rank r holds its
1/N share of the experts whole instead: every rank has every token after attention's all-reduce
and routes them all alike, computes only its own experts' terms (the kernel skips the choices
another rank holds, `cpu_moe.NOT_HELD`), and the same one all-reduce sums them — no other
communication (vLLM's expert parallelism without all-to-all). The shared expert stays sliced.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from pagedllm.distributed.layers import Linear, TPShard
from pagedllm.kernels import cpu_moe
from pagedllm.kernels.cpu_activation import silu_and_mul
from pagedllm.kernels.moe_reference import moe_experts_reference
from pagedllm.models.config import ModelConfig
from pagedllm.models.fused_linear import SINGLE
from pagedllm.models.mlp import GatedMLP
from pagedllm.models.moe_config import MoeConfig

if TYPE_CHECKING:
    from pagedllm.kernels.cpu_quant import QuantWeight


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits `[T, E]` -> (weights float32 `[T, k]`, expert ids int64 `[T, k]`):
    transformers' softmax in float32, top-k, optional renormalization."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_moe_tensor_parallel(
    moe: MoeConfig | None, tp: int, expert_parallel: bool = False
) -> None:
    """The expert counts and widths a model must have to be sharded over `tp` ranks (ValueError
    naming the field otherwise); nothing to check for a dense model."""
    if moe is None:
        return
    widths = {}
    if not expert_parallel:
        widths["moe_intermediate_size"] = moe.intermediate_size
    elif moe.num_experts % tp:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size={tp} must divide the number of "
            f"experts ({moe.num_experts}): each rank holds an equal share of them"
        )
    if moe.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    for name, width in widths.items():
        if width % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the experts' width ({name}={width})"
            )


def expert_shard(moe: MoeConfig, tp: TPShard) -> tuple[slice, TPShard]:
    """(the experts rank `tp` holds, how their width is split): with expert parallelism its
    share of the experts whole, else a slice of every expert."""
    if tp.expert_parallel:
        return tp.split(moe.num_experts), SINGLE
    return slice(0, moe.num_experts), tp


class Experts(nn.Module):
    """The SwiGLU weights of the experts this rank holds (all of them, sliced, or its share of
    them whole: `expert_shard`), stacked; see the module docstring for the layout."""

    def __init__(self, moe: MoeConfig, hidden: int, tp: TPShard = SINGLE) -> None:
        super().__init__()
        check_moe_tensor_parallel(moe, tp.size, tp.expert_parallel)
        held, width_split = expert_shard(moe, tp)
        self.first, self.num_experts, self.hidden = held.start, held.stop - held.start, hidden
        self.total_experts = moe.num_experts
        self.width = moe.intermediate_size // width_split.size
        e = self.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(e * 2 * self.width, hidden))
        self.down_proj = nn.Parameter(torch.empty(e * hidden, self.width))
        self.packed: cpu_moe.PackedExperts | None = None
        # the held experts' QuantWeights (`set_quantized`); None: float weights
        self.quant: cpu_moe.QuantExperts | None = None

    def stacked(self) -> tuple[Tensor, Tensor]:
        """(gate_up `[E, 2I, H]`, down `[E, H, I]`) views of the parameters."""
        e = self.num_experts
        return (
            self.gate_up_proj.view(e, 2 * self.width, self.hidden),
            self.down_proj.view(e, self.hidden, self.width),
        )

    def pack(self) -> bool:
        """Packs the weights for the grouped CPU kernel and drops the unpacked copies; False (and
        nothing changes) where the kernel does not run."""
        if self.packed is not None or not cpu_moe.packable(self.gate_up_proj):
            return False
        self.packed = cpu_moe.pack_experts(*self.stacked())
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.new_empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x `[T, H]`, the router's weights float32 `[T, k]` and expert ids `[T, k]` ->
        `[T, H]` (this rank's partial sum under tensor parallelism)."""
        ids = self.held_ids(ids)
        if self.quant is not None:
            return cpu_moe.moe_quant_experts(x, self.quant, weights, ids, _quant_activations())
        if self.packed is not None:
            return cpu_moe.moe_experts(x, self.packed, weights, ids)
        return moe_experts_reference(x, *self.stacked(), weights, ids)

    def set_quantized(self, gate_up: list[QuantWeight], down: list[QuantWeight]) -> None:
        """Runs the held experts on quantized weights (each expert's gate/up `[2I, H]` and down
        `[H, I]`), dropping the float parameters."""
        if len(gate_up) != self.num_experts or len(down) != self.num_experts:
            raise ValueError(
                f"quantized experts: {len(gate_up)} gate/up and {len(down)} down weights for "
                f"{self.num_experts} experts"
            )
        self.quant = cpu_moe.QuantExperts.of(gate_up, down)
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)

    def held_ids(self, ids: Tensor) -> Tensor:
        """The router's expert ids -> indexes of this rank's experts (`cpu_moe.NOT_HELD` for
        an expert another rank holds)."""
        if self.first == 0 and self.num_experts == self.total_experts:
            return ids  # every expert is held here: the ids are the indexes
        local = ids - self.first
        return local.masked_fill_((local < 0) | (local >= self.num_experts), cpu_moe.NOT_HELD)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if (q := self.quant) is not None:
            from pagedllm.kernels import cpu_quant

            for name, weights in (("gate_up_proj", q.gate_up), ("down_proj", q.down)):
                destination[prefix + name] = torch.cat([cpu_quant.dequantize(w) for w in weights])
        if self.packed is not None:
            gate_up, down = cpu_moe.unpack_experts(self.packed)
            destination[prefix + "gate_up_proj"] = gate_up.flatten(0, 1)
            destination[prefix + "down_proj"] = down.flatten(0, 1)


def _quant_activations() -> str:
    """The activations the dense quantized layers multiply with (`cpu_quant.ACTIVATIONS`)."""
    from pagedllm.kernels import cpu_quant  # only quantized models need the quantized kernels

    return cpu_quant.ACTIVATIONS


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert; `forward` maps `[T, H]` to
    `[T, H]` like the dense `GatedMLP` it replaces."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "SparseMoeBlock needs a config with `moe`"
        self.top_k, self.normalize, self.tp = moe.top_k, moe.norm_topk_prob, tp
        # Qwen's routers hand the experts weights rounded to the hidden dtype; Mixtral's stay
        # float32 (transformers)
        self.round_weights = moe.naming == "qwen"
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe, cfg.hidden_size, tp)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                cfg, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False
            )
            self.shared_expert = GatedMLP(shared, tp)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        # tokens routed to each expert since the model was built (load balance,
        # `expert_token_counts`); not a buffer: the model is built on the meta device, and this
        # is no checkpoint tensor
        self.expert_tokens = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate.forward(x), self.top_k, self.normalize)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        self._count(ids)
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate.forward(x))
            out += gate * self._shared_partial(x)
        return self.tp.all_reduce(out)

    def _count(self, ids: Tensor) -> None:
        if self.expert_tokens.device != ids.device:
            self.expert_tokens = self.expert_tokens.to(ids.device)
        # in place: `self.expert_tokens += ...` would go through nn.Module.__setattr__ each step
        self.expert_tokens.add_(torch.bincount(ids.flatten(), minlength=self.expert_tokens.numel()))

    def _shared_partial(self, x: Tensor) -> Tensor:
        # this rank's term of the shared expert, reduced with the experts' in one all-reduce
        mlp = self.shared_expert
        return mlp.down_proj.partial(silu_and_mul(mlp.gate_up_proj.forward(x)))


def pack_experts(model: nn.Module) -> int:
    """Packs every MoE block's experts for the grouped CPU kernel (after `pack_linears`, which
    packs the routers and shared experts). Returns how many were packed."""
    return sum(module.pack() for module in model.modules() if isinstance(module, Experts))


def expert_token_counts(model: nn.Module) -> dict[int, list[int]]:
    """Layer index -> tokens routed to each of its experts since the model was built, for every
    MoE layer (a token counts once per expert it chose; a preempted request's recomputed tokens
    count again, as they run again)."""
    layers = model.model.layers
    return {
        i: layer.mlp.expert_tokens.tolist()
        for i, layer in enumerate(layers)
        if isinstance(layer.mlp, SparseMoeBlock)
    }


# --- checkpoint names (the loader's layout, shapes and tensor-parallel slices) ----------------

_QWEN_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def _names(moe: MoeConfig, prefix: str) -> tuple[str, dict[str, str]]:
    """(the block's checkpoint prefix, projection -> checkpoint name) of one layer."""
    if moe.naming == "mixtral":
        return prefix + "block_sparse_moe.", _MIXTRAL_PROJ
    return prefix + "mlp.", _QWEN_PROJ


def moe_layer_layout(cfg: ModelConfig, prefix: str) -> dict[str, list[str]]:
    """Our MoE parameters of layer `prefix` -> the checkpoint tensors concatenated (dim 0)."""
    moe = cfg.moe
    block, proj = _names(moe, prefix)
    ours = prefix + "mlp."
    experts = [f"{block}experts.{e}." for e in range(moe.num_experts)]
    layout = {
        ours + "gate.weight": [block + "gate.weight"],
        ours + "experts.gate_up_proj": [
            f"{expert}{proj[part]}.weight" for expert in experts for part in ("gate", "up")
        ],
        ours + "experts.down_proj": [f"{expert}{proj['down']}.weight" for expert in experts],
    }
    if moe.shared_expert_intermediate_size:
        shared = block + "shared_expert."
        layout[ours + "shared_expert.gate_up_proj.weight"] = [
            shared + "gate_proj.weight",
            shared + "up_proj.weight",
        ]
        layout[ours + "shared_expert.down_proj.weight"] = [shared + "down_proj.weight"]
        layout[ours + "shared_expert_gate.weight"] = [block + "shared_expert_gate.weight"]
    return layout


def is_moe_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to an MoE block (not a dense layer's MLP)."""
    return (
        ".experts." in name
        or ".shared_expert" in name
        or name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))
    )


def moe_tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape the config implies for MoE checkpoint tensor `name`."""
    moe, h = cfg.moe, cfg.hidden_size
    module = name.rsplit(".", 2)[-2]
    if name.endswith("shared_expert_gate.weight"):
        return (1, h)
    if module == "gate":
        return (moe.num_experts, h)
    width = (
        moe.shared_expert_intermediate_size if ".shared_expert." in name else moe.intermediate_size
    )
    return (h, width) if module in ("down_proj", "w2") else (width, h)


def moe_shard_of(cfg: ModelConfig, name: str, tp: TPShard) -> tuple[int, slice] | None:
    """(axis, slice) of MoE checkpoint tensor `name` that rank `tp` holds; None: the whole
    tensor (the routers, the shared expert's gate, an expert held whole). An expert another rank
    holds (expert parallelism) is the empty slice: nothing of it is read."""
    module = name.rsplit(".", 2)[-2]
    if tp.size == 1 or module in ("gate", "shared_expert_gate"):
        return None
    moe = cfg.moe
    if ".shared_expert." in name:
        width, split = moe.shared_expert_intermediate_size, tp
    else:
        held, split = expert_shard(moe, tp)
        if split.size == 1:
            expert = int(name.split(".experts.", 1)[1].split(".", 1)[0])
            return None if held.start <= expert < held.stop else (0, slice(0, 0))
        width = moe.intermediate_size
    return (1, split.split(width)) if module in ("down_proj", "w2") else (0, split.split(width))
