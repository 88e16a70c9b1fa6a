"""`ModelConfig`: what the engine and the decoder need, parsed from a Hugging Face `config.json`.

Parsing is pure Python (no torch tensors), so a malformed checkpoint is rejected before any
allocation. Both config dialects are accepted: `rope_theta` + `rope_scaling` (transformers 4.x
checkpoints such as Llama 3.1) and `rope_parameters` (transformers 5.x).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from pagedllm.config import DTYPE_NAMES
from pagedllm.models.moe_config import MoeConfig, parse_moe_config

# architecture name -> family; the family selects the decoder's flags
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
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
_MODEL_TYPE_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# transformers' defaults for fields a config.json may leave out
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_ROPE_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    head_dim = _optional_int(raw, "head_dim", raw["hidden_size"] // num_heads, source)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    _check_supported_features(raw, family, source)
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        family=family,
        num_layers=raw["num_hidden_layers"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=raw["vocab_size"],
        max_position_embeddings=_optional_int(
            raw, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[family], source
        ),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=_first_id(generation, raw, "bos_token_id"),
        eos_token_ids=_eos_ids(generation or {}, raw),
        pad_token_id=_first_id(generation, raw, "pad_token_id"),
        checkpoint_dtype=_checkpoint_dtype(raw),
        path=path,
        moe=parse_moe_config(raw, architecture, raw["num_hidden_layers"], source),
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
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"{source}: field 'hidden_act' = {act!r} is not supported (only 'silu')"
        )
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{source}: field 'use_sliding_window' = true is not supported")
    if family == "llama" and raw.get("pretraining_tp", 1) not in (1, None):
        raise CheckpointError(f"{source}: field 'pretraining_tp' must be 1")


def parse_rope(raw: dict[str, Any], source: str | Path = "config.json") -> RopeConfig:
    """Read RoPE parameters from `rope_parameters` (transformers 5) or
    `rope_theta`/`rope_scaling`."""
    if isinstance(raw.get("rope_parameters"), dict):
        field_name, params = "rope_parameters", dict(raw["rope_parameters"])
    else:
        field_name, params = "rope_scaling", dict(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    # old configs spell the key "type"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: field '{field_name}.rope_type' = {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)} (or no {field_name})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: field '{field_name}.partial_rotary_factor' must be 1.0")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise CheckpointError(
            f"{source}: field '{field_name}.factor' is required for {rope_type!r}"
        )
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    missing = [name for name in _LLAMA3_ROPE_FIELDS if name not in params]
    if missing:
        raise CheckpointError(
            f"{source}: field '{field_name}' lacks {missing} for rope_type 'llama3'"
        )
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


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
