"""GGUF mixtures of experts: llama.cpp's `qwen3moe`, `qwen2moe` and `llama` with experts (Mixtral),
their metadata as a `MoeConfig` and their tensors under the Hugging Face names of the layout.

llama.cpp stores a layer's experts as one 3-D tensor per projection, `blk.N.ffn_{gate,up,down}_exps`
`[experts, out, in]` (ggml's dimension order reversed), so expert e is the contiguous row block
`e * out .. (e + 1) * out` of the tensor's bytes (`expert_rows`): each expert loads in its own
type, undequantized. The router is `ffn_gate_inp` `[experts, hidden]`; Qwen2-MoE's shared expert
is `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` (`[hidden]` or `[1, hidden]`).
The metadata: `<arch>.expert_count`, `<arch>.expert_used_count`, the expert width
`<arch>.expert_feed_forward_length` (Mixtral: `llama.feed_forward_length`), the shared expert's
`<arch>.expert_shared_feed_forward_length`. A layer is sparse when its router is in the file.
Whether the top-k weights are renormalized is not in the file: llama.cpp decides it per
architecture (Qwen3-MoE and Mixtral yes, Qwen2-MoE no), as here.
"""

from __future__ import annotations

import re

import numpy as np

from pagedllm.checkpoint.gguf_reader import GGUFError, GGUFFile
from pagedllm.models.moe_config import MoeConfig

# general.architecture of a mixture of experts -> (our architecture, family, norm_topk_prob)
GGUF_MOE_ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2", False),
    "llama": ("MixtralForCausalLM", "llama", True),  # a `llama` file with `llama.expert_count`
}
# llama.cpp's gating function key (gguf.ExpertGatingFuncType): softmax is the only one run here
_SOFTMAX_GATING = 1
_ROUTER = "ffn_gate_inp.weight"
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_BLOCK = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
_EXPERT_TENSORS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
_BLOCK_TENSORS = {
    "gate.weight": _ROUTER,
    "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def is_gguf_moe(file: GGUFFile, arch: str) -> bool:
    """Whether the file is a mixture of experts (an MoE architecture, or `llama` with experts)."""
    return arch in GGUF_MOE_ARCHITECTURES and (
        arch != "llama" or file.get("llama.expert_count") is not None
    )


def gguf_moe_config(file: GGUFFile, arch: str, num_layers: int) -> MoeConfig:
    """The MoeConfig of a mixture-of-experts file; GGUFError naming the key that is missing or
    does not fit."""

    def count(key: str) -> int:
        value = file.get(f"{arch}.{key}")
        if value is None:
            raise GGUFError(
                f"{file.path}: missing metadata key '{arch}.{key}' (mixture of experts)"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(
                f"{file.path}: metadata '{arch}.{key}' must be a positive integer, got {value!r}"
            )
        return value

    num_experts, top_k = count("expert_count"), count("expert_used_count")
    if top_k > num_experts:
        raise GGUFError(
            f"{file.path}: metadata '{arch}.expert_used_count' ({top_k}) exceeds "
            f"'{arch}.expert_count' ({num_experts})"
        )
    gating = file.get(f"{arch}.expert_gating_func", _SOFTMAX_GATING)
    if gating != _SOFTMAX_GATING:
        raise GGUFError(
            f"{file.path}: metadata '{arch}.expert_gating_func' = {gating!r} is not supported "
            f"(softmax, {_SOFTMAX_GATING}, is)"
        )
    naming = "mixtral" if arch == "llama" else "qwen"
    width = count("feed_forward_length" if naming == "mixtral" else "expert_feed_forward_length")
    shared = count("expert_shared_feed_forward_length") if arch == "qwen2moe" else 0
    sparse = tuple(i for i in range(num_layers) if f"blk.{i}.{_ROUTER}" in file.tensors)
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        norm_topk_prob=GGUF_MOE_ARCHITECTURES[arch][2],
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
        naming=naming,
    )


def moe_gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor behind a Hugging Face MoE tensor name (an expert's: the layer's 3-D
    tensor of that projection); None for a name outside the MoE blocks."""
    match = _EXPERT.fullmatch(hf_name)
    if match is not None:
        layer, _, proj = match.groups()
        return f"blk.{layer}.{_EXPERT_TENSORS[proj]}.weight"
    match = _BLOCK.fullmatch(hf_name)
    if match is not None and match.group(2) in _BLOCK_TENSORS:
        return f"blk.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}"
    return None


def expert_index(hf_name: str) -> int | None:
    """The expert of an expert's Hugging Face tensor name; None for any other name."""
    match = _EXPERT.fullmatch(hf_name)
    return None if match is None else int(match.group(2))


def stored_shapes(hf_name: str, shape: tuple[int, ...], num_experts: int) -> tuple[tuple, ...]:
    """The shapes the file may store Hugging Face tensor `hf_name` of `shape` in: an expert's
    is its projection's 3-D tensor, the shared expert's gate `[1, H]` may be `[H]`."""
    if expert_index(hf_name) is not None:
        return ((num_experts, *shape),)
    if hf_name.endswith(".shared_expert_gate.weight"):
        return (shape, shape[1:])
    return (shape,)


def expert_rows(data: np.ndarray, hf_name: str, out_features: int) -> np.ndarray:
    """The rows of the expert `hf_name` names in its 3-D tensor's bytes `[experts * out, row]`."""
    expert = expert_index(hf_name)
    return data[expert * out_features : (expert + 1) * out_features]
