"""Where a model's weights come from in a Hugging Face checkpoint: our parameter -> the tensors
concatenated to form it, each tensor's shape, and the slice a tensor-parallel rank holds. Shared
by the safetensors loader, the GGUF loader, the exporter and the LoRA manager (a module of its
own so that the loaders do not import each other for it)."""

from __future__ import annotations

from pagedllm.distributed.layers import TPShard
from pagedllm.models.config import ModelConfig
from pagedllm.models.moe import is_moe_tensor, moe_layer_layout, moe_shard_of, moe_tensor_shape


def checkpoint_layout(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the checkpoint tensors concatenated (dim 0) to form it."""
    layout: dict[str, list[str]] = {
        "model.embed_tokens.weight": ["model.embed_tokens.weight"],
        "model.norm.weight": ["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        layout["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        layout.update(_layer_layout(cfg, f"model.layers.{i}.", i))
    return layout


def _layer_layout(cfg: ModelConfig, prefix: str, index: int = 0) -> dict[str, list[str]]:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv = [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
    gate_up = [mlp + "gate_proj", mlp + "up_proj"]
    layout = {
        prefix + "input_layernorm.weight": [prefix + "input_layernorm.weight"],
        prefix + "post_attention_layernorm.weight": [prefix + "post_attention_layernorm.weight"],
        attn + "qkv_proj.weight": [name + ".weight" for name in qkv],
        attn + "o_proj.weight": [attn + "o_proj.weight"],
        mlp + "gate_up_proj.weight": [name + ".weight" for name in gate_up],
        mlp + "down_proj.weight": [mlp + "down_proj.weight"],
    }
    if cfg.moe is not None and cfg.moe.is_sparse(index):
        del layout[mlp + "gate_up_proj.weight"], layout[mlp + "down_proj.weight"]
        layout.update(moe_layer_layout(cfg, prefix))
    if cfg.qkv_bias:
        layout[attn + "qkv_proj.bias"] = [name + ".bias" for name in qkv]
    if cfg.o_bias:
        layout[attn + "o_proj.bias"] = [attn + "o_proj.bias"]
    if cfg.mlp_bias:
        layout[mlp + "gate_up_proj.bias"] = [name + ".bias" for name in gate_up]
        layout[mlp + "down_proj.bias"] = [mlp + "down_proj.bias"]
    if cfg.sandwich_norms:
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            layout[f"{prefix}{norm}.weight"] = [f"{prefix}{norm}.weight"]
    if cfg.qk_norm:
        layout[attn + "q_norm.weight"] = [attn + "q_norm.weight"]
        layout[attn + "k_norm.weight"] = [attn + "k_norm.weight"]
    return layout


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> the shape the config implies (Hugging Face naming)."""
    e, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out_features = {
        "q_proj": cfg.q_size,
        "k_proj": cfg.kv_size,
        "v_proj": cfg.kv_size,
        "o_proj": e,
        "gate_proj": inter,
        "up_proj": inter,
        "down_proj": e,
    }
    in_features = {"o_proj": cfg.q_size, "down_proj": inter}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in (n for sources in checkpoint_layout(cfg).values() for n in sources):
        module, kind = name.rsplit(".", 2)[-2:]
        if cfg.moe is not None and is_moe_tensor(name):
            shapes[name] = moe_tensor_shape(cfg, name)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (cfg.vocab_size, e)
        elif module in ("q_norm", "k_norm"):
            shapes[name] = (d,)
        elif module.endswith("norm"):
            shapes[name] = (e,)
        elif kind == "bias":
            shapes[name] = (out_features[module],)
        else:
            shapes[name] = (out_features[module], in_features.get(module, e))
    return shapes


def shard_of(cfg: ModelConfig, name: str, tp: TPShard) -> tuple[int, slice] | None:
    """(axis, slice) of checkpoint tensor `name` that rank `tp` holds; None: the whole tensor.
    The vocabulary slice may reach past `vocab_size` (the padding rows, zeros)."""
    if tp.size == 1:
        return None
    if cfg.moe is not None and is_moe_tensor(name):
        return moe_shard_of(cfg, name, tp)
    module, kind = name.rsplit(".", 2)[-2:]
    if module in ("embed_tokens", "lm_head"):
        return 0, tp.vocab_slice(cfg.vocab_size)
    if module == "q_proj":
        return 0, tp.split(cfg.q_size)
    if module in ("k_proj", "v_proj"):
        heads = tp.kv_head_slice(cfg.num_kv_heads)
        return 0, slice(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)
    if module in ("gate_proj", "up_proj"):
        return 0, tp.split(cfg.intermediate_size)
    if module in ("o_proj", "down_proj") and kind == "weight":
        return 1, tp.split(cfg.q_size if module == "o_proj" else cfg.intermediate_size)
    return None  # norms, and the row-parallel biases (added once, by rank 0)
