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


# Hugging Face tensor (of a saved tiny MoE) -> the GGUF tensor llama.cpp's converter writes; the
# experts' `{E}` tensors are stacked into one 3-D tensor per layer and projection
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.{E}.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.{E}.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.{E}.down_proj.weight": "ffn_down_exps.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.experts.{E}.w1.weight": "ffn_gate_exps.weight",
    "block_sparse_moe.experts.{E}.w3.weight": "ffn_up_exps.weight",
    "block_sparse_moe.experts.{E}.w2.weight": "ffn_down_exps.weight",
}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a `llama` file's Q and K as llama.cpp's converter permutes them."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_tensors(config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> dict:
    layers, experts = config.num_hidden_layers, _num_experts(config)
    out = {
        "token_embd.weight": tensors["model.embed_tokens.weight"],
        "output_norm.weight": tensors["model.norm.weight"],
    }
    if "lm_head.weight" in tensors:
        out["output.weight"] = tensors["lm_head.weight"]
    for i in range(layers):
        for hf, name in _GGUF_NAMES.items():
            key = f"model.layers.{i}.{hf}"
            if "{E}" in hf and key.format(E=0) in tensors:
                stacked = [tensors[key.format(E=e)] for e in range(experts)]
                out[f"blk.{i}.{name}"] = torch.stack(stacked)
            elif key in tensors:
                # the shared expert's gate `[1, H]` as `[H]` (what transformers' GGUF reader
                # expects; llama.cpp takes either)
                value = tensors[key]
                out[f"blk.{i}.{name}"] = value[0] if name == "ffn_gate_inp_shexp.weight" else value
        if config.model_type == "mixtral":
            for name, heads in (
                ("attn_q", "num_attention_heads"),
                ("attn_k", "num_key_value_heads"),
            ):
                key = f"blk.{i}.{name}.weight"
                out[key] = _llama_cpp_permute(out[key], getattr(config, heads))
    return out


def _num_experts(config: PretrainedConfig) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def _gguf_metadata(config: PretrainedConfig, family: str) -> dict[str, int | float]:
    arch = _GGUF_ARCH[family]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meta = {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "expert_count": _num_experts(config),
        "expert_used_count": config.num_experts_per_tok,
    }
    if family != "mixtral":  # Mixtral's experts are `feed_forward_length` wide
        meta["expert_feed_forward_length"] = config.moe_intermediate_size
    if family == "qwen2_moe":
        meta["expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    return {f"{arch}.{key}": value for key, value in meta.items()}


def save_tiny_moe_gguf(
    folder: str | Path,
    family: str,
    *,
    qtype: int = 8,
    seed: int = 0,
    metadata: dict | None = None,
    **overrides,
) -> Path:
    """A tiny random Qwen3-MoE, Qwen2-MoE or Mixtral (`llama` with experts) written as llama.cpp
    writes it, with the `gguf` package (no llama.cpp): attention, experts and shared expert
    quantized to `qtype` (Q8_0 by default, `gguf.quants.quantize`; widths must be multiples of
    32; F32: nothing quantized), router, norms and embedding float32. `metadata`: keys to
    change (a value None drops the key). The transformers checkpoint it was made from is saved
    beside it in `folder` (its config: transformers cannot read an expert width from a GGUF
    file). Returns the file's path."""
    import gguf
    from safetensors.torch import load_file

    folder = Path(folder)
    save_tiny_moe_checkpoint(folder, family, seed=seed, tokenizer=None, **overrides)
    config = tiny_moe_config(family, **overrides)
    path = folder / f"tiny-{family}.gguf"
    writer = gguf.GGUFWriter(str(path), _GGUF_ARCH[family])
    meta = _gguf_metadata(config, family)
    meta["tokenizer.ggml.bos_token_id"] = config.bos_token_id
    meta["tokenizer.ggml.eos_token_id"] = config.eos_token_id
    meta.update(metadata or {})
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif value is not None:
            writer.add_uint32(key, value)
    tensors = load_file(folder / "model.safetensors")
    for name, value in _gguf_tensors(config, tensors).items():
        array = value.float().numpy()
        keep_float = name.startswith(("token_embd", "output")) or "_inp" in name
        if array.ndim >= 2 and not keep_float and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
