"""GGUF metadata (llama.cpp's key names) -> `ModelConfig`, checked against the tensors' shapes.

Architectures: `llama`, `qwen2`, `qwen3`: the families the safetensors loader runs, and the
mixtures of experts `qwen3moe`, `qwen2moe` and `llama` with experts (`experts.py`). Keys are
`<arch>.<name>` (`llama.block_count`, `qwen2.attention.head_count_kv`, ...); a tied output head
is the absence of `output.weight`; the vocabulary size is the embedding's row count.
"""

from __future__ import annotations

import math

from pagedllm.checkpoint.gguf_reader import GGUFError, GGUFFile
from pagedllm.models.config import ModelConfig, RopeConfig
from pagedllm.models.gguf.experts import GGUF_MOE_ARCHITECTURES, gguf_moe_config, is_gguf_moe

# general.architecture -> (our architecture name, family)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": GGUF_MOE_ARCHITECTURES["qwen3moe"][:2],
    "qwen2moe": GGUF_MOE_ARCHITECTURES["qwen2moe"][:2],
}
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
# llama.cpp stores Llama 3.1's rope scaling as one factor per frequency in this tensor
ROPE_FREQS = "rope_freqs.weight"


def gguf_architecture(file: GGUFFile) -> str:
    arch = file.require("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{file.path}: unsupported architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_model_config(file: GGUFFile) -> ModelConfig:
    """The ModelConfig a GGUF file describes; GGUFError when its metadata is missing, of the
    wrong kind, or disagrees with its tensors."""
    arch = gguf_architecture(file)
    architecture, family = GGUF_ARCHITECTURES[arch]
    moe = is_gguf_moe(file, arch)
    if moe:
        architecture, family = GGUF_MOE_ARCHITECTURES[arch][:2]

    def count(key: str, default: int | None = None) -> int:
        value = file.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{file.path}: missing metadata key '{arch}.{key}'")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(
                f"{file.path}: metadata '{arch}.{key}' must be a positive integer, got {value!r}"
            )
        return value

    hidden = count("embedding_length")
    num_heads = count("attention.head_count")
    num_kv_heads = count("attention.head_count_kv", num_heads)
    head_dim = count("attention.key_length", hidden // num_heads)
    if count("attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{file.path}: '{arch}.attention.value_length' differs from key_length")
    if num_heads % num_kv_heads:
        raise GGUFError(
            f"{file.path}: '{arch}.attention.head_count' ({num_heads}) must be a multiple of "
            f"'{arch}.attention.head_count_kv' ({num_kv_heads})"
        )
    tensors = file.tensors
    if EMBEDDING not in tensors:
        raise GGUFError(f"{file.path}: missing tensor {EMBEDDING!r}")
    embedding = tensors[EMBEDDING]
    if len(embedding.shape) != 2 or embedding.shape[1] != hidden:
        raise GGUFError(
            f"{file.path}: tensor {EMBEDDING!r} has shape {list(embedding.shape)}, metadata "
            f"'{arch}.embedding_length' = {hidden} implies [vocab, {hidden}]"
        )
    num_layers = count("block_count")
    moe_config = gguf_moe_config(file, arch, num_layers) if moe else None
    # a mixture of experts' dense layers (if any) are `feed_forward_length` wide
    dense_width = count("feed_forward_length", moe_config.intermediate_size) if moe_config else None
    eos_ids = [
        file.get(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    return ModelConfig(
        architecture=architecture,
        family=family,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=dense_width or count("feed_forward_length"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=embedding.shape[0],
        max_position_embeddings=count("context_length"),
        rms_norm_eps=float(file.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope(file, arch, head_dim),
        tie_word_embeddings=OUTPUT not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        qk_norm=family == "qwen3",
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if isinstance(i, int))),
        pad_token_id=file.get("tokenizer.ggml.padding_token_id"),
        checkpoint_dtype=None,
        path=str(file.path),
        moe=moe_config,
    )


def _rope(file: GGUFFile, arch: str, head_dim: int) -> RopeConfig:
    theta = float(file.get(f"{arch}.rope.freq_base", 10000.0))
    dims = file.get(f"{arch}.rope.dimension_count", head_dim)
    if dims != head_dim:
        raise GGUFError(
            f"{file.path}: '{arch}.rope.dimension_count' = {dims} (partial rotary) is not "
            f"supported; it must equal the head size {head_dim}"
        )
    scaling = file.get(f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS in file.tensors:
        return _llama3_rope(file, theta, head_dim)
    if scaling == "none":
        return RopeConfig(theta=theta)
    if scaling == "linear":
        return RopeConfig(
            theta=theta,
            rope_type="linear",
            factor=float(file.require(f"{arch}.rope.scaling.factor")),
        )
    raise GGUFError(
        f"{file.path}: '{arch}.rope.scaling.type' = {scaling!r} is not supported "
        "(supported: none, linear, and Llama 3's rope_freqs)"
    )


def _llama3_rope(file: GGUFFile, theta: float, head_dim: int) -> RopeConfig:
    """Llama 3.1's scaling, recovered from llama.cpp's per-frequency factors: 1 for short
    wavelengths, `factor` for long ones, and between them a factor whose inverse is linear in
    the frequency, which fixes the band (given the usual original context of 8192)."""
    import numpy as np

    tensor = file.tensors[ROPE_FREQS]
    factors = (
        tensor.data.view(np.float32).reshape(-1).astype(np.float64) if tensor.qtype == 0 else None
    )
    if factors is None or factors.size != head_dim // 2:
        raise GGUFError(f"{file.path}: tensor {ROPE_FREQS!r} must be F32 [{head_dim // 2}]")
    inv_freq = theta ** -(np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    band = np.flatnonzero((factors > 1.0 + 1e-6) & (factors < factor - 1e-6))
    if factor <= 1.0 or band.size < 2:
        raise GGUFError(f"{file.path}: tensor {ROPE_FREQS!r} is not Llama 3 style rope scaling")
    # inside the band 1 / f = (1 - s) / factor + s with s = a * inv_freq - b
    s = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, b = np.polyfit(inv_freq[band], s, 1)
    old_ctx = 8192
    width = old_ctx / (2 * math.pi * a)  # high_freq_factor - low_freq_factor
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(b * width),
        high_freq_factor=float(b * width + width),
        original_max_position_embeddings=old_ctx,
    )
