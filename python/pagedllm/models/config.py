"""`ModelConfig`: what the engine and the decoder need, parsed from a Hugging Face `config.json`.

Parsing is pure Python (no torch tensors), so a malformed checkpoint is rejected before any
allocation. Both config dialects are accepted: `rope_theta` + `rope_scaling` (transformers 4.x
checkpoints such as Llama 3.1) and `rope_parameters` (transformers 5.x). Sliding-window layers
and the Gemma families' flags are read by `models/layer_types.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagedllm.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from pagedllm.config import DTYPE_NAMES
from pagedllm.models.layer_types import (
    gemma_fields,
    global_rope_params,
    layer_windows,
    local_rope,
)
from pagedllm.models.moe_config import MoeConfig, parse_moe_config
from pagedllm.models.rope import RopeConfig, parse_rope

# architecture name -> family; the family selects the decoder's flags
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# mixtures of experts: the family's attention, the MoE block (models/moe.py) for the MLP
MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2",
    "MixtralForCausalLM": "llama",
}
# a dense family's decoder with a classification head (`score`) for the pooling runner
SEQUENCE_CLASSIFICATION_ARCHITECTURES = {
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
_MODEL_TYPE_FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
# transformers' defaults for fields a config.json may leave out
_DEFAULT_MAX_POSITIONS = {
    "llama": 2048,
    "qwen2": 32768,
    "qwen3": 32768,
    "mistral": 131072,
    "gemma2": 8192,
    "gemma3": 131072,
}
# Gemma's defaults (transformers' Gemma2Config / Gemma3TextConfig)
_GEMMA_HEAD_DIM = 256
_REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes, architecture flags and special tokens of a decoder-only checkpoint."""

    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # "llama" | "qwen2" | "qwen3"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, Llama/Qwen3 `attention_bias`)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 `attention_bias`)
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (generation_config wins)
    pad_token_id: int | None = None
    checkpoint_dtype: str | None = None  # "float16" | "bfloat16" | "float32" as saved, if stated
    path: str | None = None  # checkpoint folder; None for built-in models
    moe: MoeConfig | None = None  # the sparse MLP blocks of a mixture of experts
    # sliding window W of each layer (0: full attention); empty: every layer full
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh" (Gemma)
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight), offset 1
    embed_scale: float = 1.0  # Gemma: the input embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    attn_softcap: float = 0.0  # Gemma 2: scores capped as cap * tanh(score / cap) (0: none)
    final_softcap: float = 0.0  # Gemma 2: the same for the logits
    query_pre_attn_scalar: float | None = None  # Gemma: softmax scale is its -1/2 power
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own RoPE

    def window(self, layer: int) -> int:
        """Sliding window of `layer` (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        """The softmax scale: head_dim^-1/2, or Gemma's query_pre_attn_scalar^-1/2."""
        base = self.query_pre_attn_scalar or self.head_dim
        return base**-0.5

    @property
    def longest_context(self) -> int:
        """The longest context the model's RoPE covers: max_position_embeddings, or more with
        a scaling that extends it (`rope.RopeConfig.longest_context`)."""
        native = self.max_position_embeddings
        scaled = replace(self.rope, max_positions=native).longest_context
        return max(native, scaled)

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (first of `eos_token_ids`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, naming the file in every error."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_model_config(folder: str | Path) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` if present) of a checkpoint folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"model folder {folder} does not exist or is not a directory")
    raw = read_json(folder / "config.json")
    generation = _read_optional_json(folder / "generation_config.json")
    return parse_model_config(raw, generation, source=folder / "config.json", path=str(folder))


def _read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.exists() else {}


def parse_model_config(
    raw: dict[str, Any],
    generation: dict[str, Any] | None = None,
    *,
    source: str | Path = "config.json",
    path: str | None = None,
) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json dict; `source` names the file in errors."""
    architecture, family = _architecture(raw, source)
    for name in _REQUIRED_FIELDS:
        _require_int(raw, name, source)
    num_heads = raw["num_attention_heads"]
    num_kv_heads = _optional_int(raw, "num_key_value_heads", num_heads, source)
    default_head_dim = raw["hidden_size"] // num_heads
    if family.startswith("gemma"):
        default_head_dim = _GEMMA_HEAD_DIM
    head_dim = _optional_int(raw, "head_dim", default_head_dim, source)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    _check_supported_features(raw, family, source)
    attention_bias = bool(raw.get("attention_bias", False))
    num_layers = raw["num_hidden_layers"]
    gemma = gemma_fields(raw, family, source)
    max_positions = _optional_int(
        raw, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[family], source
    )
    # the RoPE tables depend on the context length (dynamic, longrope): the family's default
    raw = {"max_position_embeddings": max_positions, **raw}
    return ModelConfig(
        architecture=architecture,
        family=family,
        num_layers=num_layers,
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=raw["vocab_size"],
        max_position_embeddings=max_positions,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw, source, global_rope_params(raw, family)),
        # Gemma ties its head to the embedding unless told otherwise (transformers' default)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.startswith("gemma"))),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "gemma3"),
        bos_token_id=_first_id(generation, raw, "bos_token_id"),
        eos_token_ids=_eos_ids(generation or {}, raw),
        pad_token_id=_first_id(generation, raw, "pad_token_id"),
        checkpoint_dtype=_checkpoint_dtype(raw),
        path=path,
        moe=parse_moe_config(raw, architecture, num_layers, source),
        layer_windows=layer_windows(raw, family, num_layers, source),
        local_rope=local_rope(raw, family, source),
        **gemma,
    )


def _architecture(raw: dict[str, Any], source: str | Path) -> tuple[str, str]:
    known = {
        **SUPPORTED_ARCHITECTURES,
        **MOE_ARCHITECTURES,
        **SEQUENCE_CLASSIFICATION_ARCHITECTURES,
    }
    supported = ", ".join(known)
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise CheckpointError(f"{source}: field 'architectures' must be a list of names")
    for name in architectures:
        if name in known:
            return name, known[name]
    if architectures:
        raise CheckpointError(
            f"{source}: unsupported architecture {architectures} (field 'architectures'); "
            f"supported: {supported}"
        )
    model_type = raw.get("model_type")
    family = _MODEL_TYPE_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise CheckpointError(
            f"{source}: unsupported or missing model_type {model_type!r} and no 'architectures' "
            f"field; supported architectures: {supported}"
        )
    name = next(arch for arch, fam in SUPPORTED_ARCHITECTURES.items() if fam == family)
    return name, family


def _require_int(raw: dict[str, Any], name: str, source: str | Path) -> int:
    if name not in raw:
        raise CheckpointError(f"{source}: missing required field '{name}'")
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{source}: field '{name}' must be a positive integer, got {value!r}")
    return value


def _optional_int(raw: dict[str, Any], name: str, default: int, source: str | Path) -> int:
    if raw.get(name) is None:
        return default
    return _require_int(raw, name, source)


def _check_supported_features(raw: dict[str, Any], family: str, source: str | Path) -> None:
    if not family.startswith("gemma"):  # Gemma's activation: `layer_types.gemma_fields`
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(
                f"{source}: field 'hidden_act' = {act!r} is not supported (only 'silu')"
            )
    if family == "llama" and raw.get("pretraining_tp", 1) not in (1, None):
        raise CheckpointError(f"{source}: field 'pretraining_tp' must be 1")


def _first_id(generation: dict[str, Any] | None, raw: dict[str, Any], name: str) -> int | None:
    for source in (generation or {}, raw):
        value = source.get(name)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return None


def _eos_ids(generation: dict[str, Any], raw: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what `generate` stops on (Llama 3 lists several ids there)
    for source in (generation, raw):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value:
            return tuple(int(v) for v in value)
    return ()


def _checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    value = raw.get("torch_dtype", raw.get("dtype"))
    return value if value in DTYPE_NAMES else None
