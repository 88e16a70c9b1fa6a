"""Export our decoder back to Hugging Face `transformers`: config, state dict, model, and a
checkpoint folder.

Used by `pagedllm bench --compare-transformers`, by `pagedllm export-tiny` (checkpoint folders
a new user can point `--model` and draft models at; `save_checkpoint` needs no
`transformers`), and by parity tests that run the same weights through `transformers` as an
outside oracle. `transformers` is an optional dependency, imported only inside the functions
that need it, so `import pagedllm.models` never pulls it in.

The parameter-name mapping is `layout.checkpoint_layout` (our name -> the HF tensors concatenated
along dim 0) and the split sizes come from `layout.expected_shapes`: loading and exporting share
one definition of the checkpoint format.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from pagedllm.models.config import ModelConfig
from pagedllm.models.layout import checkpoint_layout, expected_shapes
from pagedllm.models.loader import SINGLE_FILE, TORCH_DTYPES

if TYPE_CHECKING:  # only for annotations; never imported at run time here
    from transformers import PretrainedConfig, PreTrainedModel

_INSTALL_HINT = (
    "pagedllm.models.hf_export needs the optional dependency 'transformers' "
    "(pip install 'transformers>=4.45' or pip install 'pagedllm[test]')"
)
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return transformers


def _model_config(model: nn.Module, cfg: ModelConfig | None) -> ModelConfig:
    cfg = cfg if cfg is not None else getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            "pass the model's ModelConfig (cfg=...) or a DecoderForCausalLM with `.config`"
        )
    return cfg


def _check_representable(cfg: ModelConfig) -> None:
    """Reject flag combinations that no transformers config of the family can express."""
    if cfg.family not in ("llama", "qwen2", "qwen3") or cfg.layer_windows:
        raise ValueError(
            f"cannot export {cfg.architecture} to transformers: only Llama, Qwen2 and Qwen3 "
            f"without sliding windows are exported"
        )
    if cfg.rope.rope_type not in ("default", "linear", "llama3"):
        raise ValueError(
            f"cannot export {cfg.architecture} to transformers: rope_type "
            f"{cfg.rope.rope_type!r} is not exported"
        )
    problems = []
    if cfg.family == "qwen2":
        # Qwen2 hard-codes bias on q/k/v and none on o_proj; it has no q/k norm or MLP bias
        if not cfg.qkv_bias or cfg.o_bias:
            problems.append("qwen2 needs qkv_bias=True and o_bias=False")
    elif cfg.qkv_bias != cfg.o_bias:
        # Llama/Qwen3 have one `attention_bias` flag for q/k/v and o together
        problems.append(
            f"{cfg.family} has one attention_bias for q/k/v and o (got {cfg.qkv_bias}/{cfg.o_bias})"
        )
    if cfg.qk_norm != (cfg.family == "qwen3"):
        problems.append(f"qk_norm={cfg.qk_norm} is not expressible for {cfg.family}")
    if cfg.mlp_bias and cfg.family != "llama":
        problems.append(f"mlp_bias is only expressible for llama, not {cfg.family}")
    if problems:
        raise ValueError(
            f"cannot export {cfg.architecture} to transformers: " + "; ".join(problems)
        )


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    rope = cfg.rope
    if rope.rope_type == "default":
        return None
    if rope.rope_type == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    return {
        "rope_type": "llama3",
        "factor": rope.factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
    }


def _eos_value(cfg: ModelConfig) -> int | list[int] | None:
    # config.json convention: an int for one id, a list when there are several (Llama 3)
    if not cfg.eos_token_ids:
        return None
    return cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)


def _config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The family's config fields with exactly the shapes and flags of `cfg` (checked)."""
    _check_representable(cfg)
    fields: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        # rope_theta + rope_scaling: transformers 4.x reads them, 5.x folds them into
        # rope_parameters
        rope_theta=cfg.rope.theta,
        rope_scaling=_rope_scaling(cfg),
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=_eos_value(cfg),
        pad_token_id=cfg.pad_token_id,
    )
    if cfg.family == "llama":
        fields.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, pretraining_tp=1)
    elif cfg.family == "qwen3":
        fields.update(attention_bias=cfg.qkv_bias, use_sliding_window=False)
    else:
        fields.update(use_sliding_window=False)
    return fields


def hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The LlamaConfig / Qwen2Config / Qwen3Config with exactly the shapes and flags of `cfg`.

    Raises ValueError for flag combinations the family's transformers config cannot express.
    """
    transformers = _import_transformers()
    _check_representable(cfg)
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[cfg.family]
    config = config_class(**_config_fields(cfg))
    config.architectures = [cfg.architecture]
    if cfg.checkpoint_dtype is not None:
        _set_config_dtype(config, cfg.checkpoint_dtype)
    return config


def config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The `config.json` of `cfg` as a dict, without `transformers`: the fields `hf_config`
    sets, named as transformers 4 writes them (transformers 5 and our loader read them too)."""
    config = {"architectures": [cfg.architecture], "model_type": cfg.family}
    config.update(_config_fields(cfg))
    if cfg.checkpoint_dtype is not None:
        config["torch_dtype"] = cfg.checkpoint_dtype
    return config


def _set_config_dtype(config: PretrainedConfig, dtype: str) -> None:
    # transformers 5 renamed `torch_dtype` to `dtype` (the old name still works, with a warning)
    if hasattr(config, "dtype"):
        config.dtype = dtype
    else:
        config.torch_dtype = dtype


def hf_state_dict(model: nn.Module, cfg: ModelConfig | None = None) -> dict[str, Tensor]:
    """Our parameters under Hugging Face names, fused q/k/v and gate/up split back.

    The tensors are views of the model's own storage (no copy). With tied embeddings there is no
    `lm_head.weight`, as in HF checkpoints.
    """
    cfg = _model_config(model, cfg)
    ours = model.state_dict()
    layout = checkpoint_layout(cfg)
    unexpected = (
        set(ours) - set(layout) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    )
    if unexpected:
        raise ValueError(
            f"model has parameters the checkpoint layout does not know: {sorted(unexpected)}"
        )
    shapes = expected_shapes(cfg)
    out: dict[str, Tensor] = {}
    for name, sources in layout.items():
        if name not in ours:
            raise ValueError(f"model lacks parameter '{name}' that {cfg.architecture} implies")
        tensor = ours[name].detach()
        sizes = [shapes[source][0] for source in sources]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(
                f"parameter '{name}' has {tensor.shape[0]} rows, the config implies {sum(sizes)}"
            )
        for source, part in zip(sources, tensor.split(sizes, dim=0)):
            if part.shape != shapes[source]:
                raise ValueError(
                    f"'{source}' would have shape {list(part.shape)}, "
                    f"config implies {list(shapes[source])}"
                )
            out[source] = part
    return out


def to_transformers(model: nn.Module, cfg: ModelConfig | None = None) -> PreTrainedModel:
    """A transformers `*ForCausalLM` with our weights, on the model's device and dtype, in eval
    mode.

    The transformers model is built on the meta device and its parameters are assigned views of
    our tensors, so no second copy of the weights is allocated (the engine's model and the export
    share storage; neither is meant to be trained). Gradients are off.
    """
    transformers = _import_transformers()
    cfg = _model_config(model, cfg)
    weight = model.get_parameter("model.embed_tokens.weight")
    device, dtype = weight.device, weight.dtype
    config = hf_config(cfg)
    _set_config_dtype(config, _DTYPE_NAMES.get(dtype, cfg.checkpoint_dtype or "float32"))
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    state = hf_state_dict(model, cfg)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()
    _rebuild_meta_buffers(hf_model, config, device)
    hf_model.generation_config = _generation_config(transformers, cfg)
    return hf_model.requires_grad_(False).eval()


def _rebuild_meta_buffers(
    hf_model: nn.Module, config: PretrainedConfig, device: torch.device
) -> None:
    """Non-persistent buffers (RoPE inv_freq) are computed at construction, so they are still on
    meta after loading: rebuild the modules that own them from the config, on the target device."""
    for name, module in list(hf_model.named_modules()):
        if not any(buf.is_meta for buf in module.buffers(recurse=False)):
            continue
        if any(p.is_meta for p in module.parameters(recurse=False)):
            raise RuntimeError(f"transformers module '{name}' has parameters that were not loaded")
        with torch.device(device):
            rebuilt = type(module)(config=config)
        parent_name, _, attr = name.rpartition(".")
        setattr(hf_model.get_submodule(parent_name), attr, rebuilt)
    left = [n for n, t in [*hf_model.named_parameters(), *hf_model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(
            f"transformers model still has uninitialised tensors after export: {left}"
        )


def _generation_config(transformers, cfg: ModelConfig):
    eos = list(cfg.eos_token_ids) or None
    return transformers.GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=eos[0] if eos and len(eos) == 1 else eos,
        pad_token_id=cfg.pad_token_id,
    )


def save_checkpoint(model: nn.Module, folder: str | Path, *, num_layers: int | None = None) -> Path:
    """`model` as a checkpoint folder our loader and `transformers` read: `config.json`,
    `generation_config.json` and `model.safetensors` (in the model's dtype). No tokenizer.

    `num_layers` keeps only the first decoder layers (with the same embeddings, final norm and
    head): a smaller model with the same vocabulary, e.g. a draft model for speculative
    decoding. Needs no `transformers`.
    """
    from safetensors.torch import save_file

    cfg = _model_config(model, None)
    kept = cfg.num_layers if num_layers is None else num_layers
    if not 1 <= kept <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = config_json(dataclasses.replace(cfg, num_layers=kept))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_value(cfg),
        "pad_token_id": cfg.pad_token_id,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    # safetensors wants contiguous tensors that do not share storage: the split views do
    tensors = {
        name: tensor.to("cpu").contiguous().clone()
        for name, tensor in hf_state_dict(model, cfg).items()
        if _layer_of(name) < kept
    }
    # transformers refuses safetensors files without the {"format": "pt"} metadata
    save_file(tensors, folder / SINGLE_FILE, metadata={"format": "pt"})
    return folder


def _layer_of(name: str) -> int:
    """The decoder layer a tensor belongs to; -1 for embeddings, final norm, head."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1
