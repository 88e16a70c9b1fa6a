"""A GGUF file's tensors -> the decoder's parameters, quantized weights kept in their type.

The decoder's layout (`models/layout.py`: fused q/k/v and gate/up, Hugging Face names) is reused:
each Hugging Face name maps to one GGUF tensor (`gguf_tensor_name`), so the shape checks and the
tensor-parallel slices (`shard_of`) are the safetensors loader's own rules.

On the CPU in float32 the linear layers and the embedding keep their GGUF type: their rows go to
`kernels.cpu_quant` (`make_weight`) as the mapped file's bytes, and the layers' `quant` slot
(`distributed/layers.py`) runs them. F32 matrices, norms and biases become float32 tensors.
Elsewhere (CUDA, or another dtype) every tensor is dequantized to the model's dtype at load.

llama.cpp's converter permutes the rows of Q and K of the `llama` architecture (its RoPE rotates
interleaved pairs; ours rotates halves): the rows are put back in whole (`unpermute_rows`), which
needs no dequantization.

A mixture of experts' experts (`experts.py`: one 3-D tensor per projection) load per expert, each
a `QuantWeight` of its row block, into the MoE block's `Experts.quant`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.checkpoint.gguf_reader import (
    GGUFError,
    GGUFFile,
    RawTensor,
    ggml_type_name,
    open_gguf,
)
from pagedllm.distributed.layers import QuantEmbedding, TPShard
from pagedllm.models.config import ModelConfig
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.fused_linear import SINGLE
from pagedllm.models.gguf.experts import expert_rows, moe_gguf_name, stored_shapes
from pagedllm.models.layout import checkpoint_layout, expected_shapes, shard_of

logger = logging.getLogger(__name__)

F32, F16, BF16 = 0, 1, 30
_FLOAT_VIEWS = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# our parameters kept quantized (the modules with a `quant` slot)
_QUANT_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "embed_tokens")


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF tensor behind a Hugging Face tensor name of the decoder's layout."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    moe_name = moe_gguf_name(hf_name)
    if moe_name is not None:
        return moe_name
    match = _LAYER.fullmatch(hf_name)
    if match is None:
        raise KeyError(hf_name)
    layer, rest = match.groups()
    if rest in _LAYER_NAMES:
        return f"blk.{layer}.{_LAYER_NAMES[rest]}"
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def check_gguf_tensors(file: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the config implies is present, of a supported type, with its shape."""
    from pagedllm.kernels import cpu_quant

    for hf_name, shape in expected_shapes(cfg).items():
        name = gguf_tensor_name(hf_name)
        tensor = file.tensors.get(name)
        if tensor is None:
            raise GGUFError(f"{file.path}: missing tensor {name!r}")
        if tensor.qtype not in cpu_quant.SUPPORTED:
            supported = ", ".join(sorted(ggml_type_name(t) for t in cpu_quant.SUPPORTED))
            raise GGUFError(
                f"{file.path}: tensor {name!r} has type {tensor.type_name}, which pagedllm does "
                f"not run (supported: {supported})"
            )
        allowed = stored_shapes(hf_name, shape, cfg.moe.num_experts) if cfg.moe else (shape,)
        if tensor.shape not in allowed:
            raise GGUFError(
                f"{file.path}: tensor {name!r} has shape {list(tensor.shape)}, the metadata "
                f"implies {list(allowed[0])} (inconsistent metadata)"
            )


def unpermute_rows(rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (transformers' `reverse_permute`):
    within each head, stored row 2j + i is our row i * half + j."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)


@dataclass(frozen=True)
class _Part:
    """A matrix's rows as stored: uint8 `[rows, row_bytes]` of one ggml type."""

    qtype: int
    data: np.ndarray
    in_features: int


def to_float(qtype: int, data: np.ndarray, in_features: int) -> torch.Tensor:
    """Rows of any supported type as float32 `[rows, in_features]`."""
    if qtype in _FLOAT_VIEWS:
        flat = torch.from_numpy(np.ascontiguousarray(data)).view(_FLOAT_VIEWS[qtype])
        return flat.reshape(data.shape[0], in_features).float()
    import gguf

    values = gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values.reshape(data.shape[0], in_features))


class GGUFModelBuilder:
    """Reads one rank's parameters out of a GGUF file into a meta-built decoder."""

    def __init__(
        self,
        file: GGUFFile,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPShard = SINGLE,
    ) -> None:
        self.file, self.cfg, self.device, self.dtype, self.tp = file, cfg, device, dtype, tp
        # the quantized kernels run on the CPU in float32; elsewhere everything is dequantized
        self.keep_quantized = device.type == "cpu" and dtype == torch.float32
        if not self.keep_quantized:
            logger.info(
                "%s: GGUF weights dequantized to %s at load (quantized kernels run on the CPU "
                "in float32 only)",
                file.path.name,
                dtype,
            )

    def build(self) -> DecoderForCausalLM:
        check_gguf_tensors(self.file, self.cfg)
        with torch.device("meta"):
            model = DecoderForCausalLM(self.cfg, self.tp)
        state: dict[str, torch.Tensor] = {}
        quant: dict[str, object] = {}
        quant_experts: dict[str, object] = {}
        shapes = {name: param.shape for name, param in model.named_parameters()}
        for param, sources in checkpoint_layout(self.cfg).items():
            module = param.rsplit(".", 2)[-2]
            if module == "experts":
                self._read_experts(param, sources, state, quant_experts)
                continue
            parts = (
                [self._read_matrix(name) for name in sources]
                if param.endswith("weight") and module in _QUANT_MODULES
                else None
            )
            if parts is not None and self.keep_quantized and any(p.qtype != F32 for p in parts):
                quant[param.removesuffix(".weight")] = self._quant_weight(parts)
            elif parts is not None:
                state[param] = self._dense(torch.cat([to_float(*_args(p)) for p in parts]))
            else:
                # (a router, a shared expert's gate: matrices read whole, in float32)
                values = torch.cat([self._read_vector(n) for n in sources])
                state[param] = self._dense(values.reshape(shapes[param]))
        self._install_quantized(model, quant)
        for name, (gate_up, down) in quant_experts.items():
            model.get_submodule(name).set_quantized(gate_up, down)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        left = set(missing) - {f"{name}.weight" for name in quant} - {"lm_head.weight"}
        left -= {f"{name}.{p}" for name in quant_experts for p in ("gate_up_proj", "down_proj")}
        if left or unexpected:  # a layout bug, not a bad file
            raise RuntimeError(f"GGUF load left {sorted(left)} unset, {unexpected} unexpected")
        model.tie_weights()
        if self.cfg.tie_word_embeddings and "model.embed_tokens" in quant:
            model.lm_head.quant = quant["model.embed_tokens"]
        model.reset_rotary()
        return model.requires_grad_(False).eval()

    def _install_quantized(self, model: DecoderForCausalLM, quant: dict[str, object]) -> None:
        for name, weight in quant.items():
            if name == "model.embed_tokens" and self.tp.size == 1:
                model.model.embed_tokens = QuantEmbedding(weight)
                continue
            module = model.get_submodule(name)
            module.quant = weight
            module.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def _read_experts(self, param: str, sources: list[str], state: dict, quant: dict) -> None:
        """The experts this rank holds (an expert another rank holds reads as no rows): a
        `QuantWeight` per expert and projection into `quant`, or float tensors into `state`."""
        parts = [self._read_matrix(name) for name in sources]
        if not (self.keep_quantized and any(p.qtype != F32 for p in parts)):
            held = [to_float(*_args(p)) for p in parts if p.data.shape[0]]
            state[param] = self._dense(torch.cat(held))
            return
        per_expert = 2 if param.endswith("gate_up_proj") else 1  # gate and up rows, or down's
        weights = [
            self._quant_weight(parts[i : i + per_expert])
            for i in range(0, len(parts), per_expert)
            if parts[i].data.shape[0]
        ]
        module = param.rsplit(".", 1)[0]
        gate_up, down = quant.get(module, (None, None))
        quant[module] = (weights, down) if per_expert == 2 else (gate_up, weights)

    def _quant_weight(self, parts: list[_Part]):
        from pagedllm.kernels import cpu_quant

        segments = [(p.qtype, torch.from_numpy(np.ascontiguousarray(p.data))) for p in parts]
        return cpu_quant.make_weight(segments, parts[0].in_features)

    def _dense(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype)

    def _raw(self, hf_name: str) -> RawTensor:
        return self.file.tensors[gguf_tensor_name(hf_name)]

    def _heads_permuted(self, hf_name: str) -> int | None:
        """Heads of a Q/K tensor llama.cpp stored permuted (the `llama` architecture only)."""
        if self.cfg.family != "llama":
            return None
        if ".q_proj." in hf_name:
            return self.cfg.num_heads
        if ".k_proj." in hf_name:
            return self.cfg.num_kv_heads
        return None

    def _read_matrix(self, hf_name: str) -> _Part:
        raw = self._raw(hf_name)
        data, in_features = raw.data, raw.shape[-1]
        if len(raw.shape) == 3:  # an expert: its rows of the layer's 3-D tensor
            data = expert_rows(data, hf_name, raw.shape[1])
        heads = self._heads_permuted(hf_name)
        if heads is not None:
            data = data[unpermute_rows(data.shape[0], heads)]
        shard = shard_of(self.cfg, hf_name, self.tp)
        if shard is not None:
            axis, span = shard
            if axis == 0:
                data = _rows(data, span)
            else:
                data, in_features = self._columns(raw, data, span), span.stop - span.start
        return _Part(raw.qtype, data, in_features)

    def _columns(self, raw: RawTensor, data: np.ndarray, span: slice) -> np.ndarray:
        """Columns `span` of quantized rows: whole blocks only."""
        import gguf

        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw.qtype)]
        if span.start % block or span.stop % block:
            raise GGUFError(
                f"{self.file.path}: tensor {raw.name!r} ({raw.type_name}, blocks of {block} "
                f"values) cannot be split at columns {span.start}:{span.stop} for "
                f"tensor_parallel_size={self.tp.size}: the split must fall on block boundaries"
            )
        return data[:, span.start // block * block_bytes : span.stop // block * block_bytes]

    def _read_vector(self, hf_name: str) -> torch.Tensor:
        raw = self._raw(hf_name)
        values = to_float(raw.qtype, raw.data, raw.shape[-1]).reshape(-1)
        heads = self._heads_permuted(hf_name)
        if heads is not None:
            values = values[torch.from_numpy(unpermute_rows(values.numel(), heads))]
        shard = shard_of(self.cfg, hf_name, self.tp)
        return values if shard is None else values[shard[1]]


def _args(part: _Part) -> tuple[int, np.ndarray, int]:
    return part.qtype, part.data, part.in_features


def _rows(data: np.ndarray, span: slice) -> np.ndarray:
    """Rows `span`, zero bytes past the end (the padded vocabulary: zero bytes are zeros in
    every supported type)."""
    part = data[span.start : min(span.stop, data.shape[0])]
    missing = span.stop - span.start - part.shape[0]
    if missing > 0:
        part = np.concatenate([part, np.zeros((missing, data.shape[1]), dtype=np.uint8)])
    return part


def load_gguf_model(
    path: str,
    cfg: ModelConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPShard = SINGLE,
) -> DecoderForCausalLM:
    """The decoder of a GGUF file (this rank's shard with a `tp` of more than one rank)."""
    return GGUFModelBuilder(open_gguf(path), cfg, device, dtype, tp).build()
