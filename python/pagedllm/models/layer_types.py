"""Per-layer attention types and the Gemma families' flags, read from a config.json.

- Sliding windows: a layer of type `sliding_attention` sees the last `sliding_window` positions
  (itself included, `transformers`' mask). Where the types come from: `layer_types` when the
  config lists them (transformers 5 saves them); otherwise Mistral slides on every layer
  (`sliding_window` missing = 4096 as in `transformers`, explicit null = none), Qwen2/Qwen3 on
  layers with index >= `max_window_layers` when `use_sliding_window`, Gemma 2 on every other
  layer (even indices), Gemma 3 on all but every `sliding_window_pattern`-th layer.
- Gemma 3's RoPE: nested `rope_parameters` per layer type, or the older `rope_theta` +
  `rope_scaling` for the global layers and `rope_local_base_freq` for the sliding ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.checkpoint.errors import CheckpointError
from pagedllm.models.rope import RopeConfig, parse_rope

LAYER_TYPES = ("full_attention", "sliding_attention")
_MISTRAL_DEFAULT_WINDOW = 4096
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' defaults: Gemma2Config / Gemma3TextConfig
_GEMMA_DEFAULTS = {
    "gemma2": dict(sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(sliding_window=4096, attn_logit_softcapping=None, final_logit_softcapping=None),
}


def layer_windows(
    raw: dict[str, Any], family: str, num_layers: int, source: str | Path
) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention); () when every layer is full."""
    window = _window_size(raw, family, source)
    if not window:
        return ()
    types = _layer_types(raw, family, num_layers, source)
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return windows if any(windows) else ()


def _window_size(raw: dict[str, Any], family: str, source: str | Path) -> int:
    if family == "mistral":
        value = raw.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
    elif family in ("qwen2", "qwen3"):
        value = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    elif family in _GEMMA_DEFAULTS:
        value = raw.get("sliding_window", _GEMMA_DEFAULTS[family]["sliding_window"])
    else:
        return 0
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(
            f"{source}: field 'sliding_window' must be a positive integer or null, got {value!r}"
        )
    return value


def _layer_types(
    raw: dict[str, Any], family: str, num_layers: int, source: str | Path
) -> list[str]:
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise CheckpointError(
                f"{source}: field 'layer_types' must list one type per layer ({num_layers})"
            )
        for i, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                raise CheckpointError(
                    f"{source}: field 'layer_types[{i}]' = {kind!r} is not supported; "
                    f"supported: {', '.join(LAYER_TYPES)}"
                )
        return types
    if family == "mistral":
        return ["sliding_attention"] * num_layers
    if family in ("qwen2", "qwen3"):
        first = raw.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    pattern = 2 if family == "gemma2" else raw.get("sliding_window_pattern", 6)
    if not isinstance(pattern, int) or pattern <= 0:
        raise CheckpointError(
            f"{source}: field 'sliding_window_pattern' must be a positive integer, got {pattern!r}"
        )
    # every pattern-th layer (1-based) is global
    return [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(num_layers)]


def gemma_fields(raw: dict[str, Any], family: str, source: str | Path) -> dict[str, Any]:
    """The ModelConfig fields that set Gemma 2/3 apart ({} for other families)."""
    if family not in _GEMMA_DEFAULTS:
        return {}
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GEMMA_ACTIVATIONS:
        raise CheckpointError(
            f"{source}: field 'hidden_activation' = {act!r} is not supported; "
            f"supported: {', '.join(_GEMMA_ACTIVATIONS)}"
        )
    defaults = _GEMMA_DEFAULTS[family]
    caps = {
        name: raw.get(name, defaults[name])
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    return dict(
        hidden_act="gelu_pytorch_tanh",
        norm_offset=1.0,
        embed_scale=raw["hidden_size"] ** 0.5,
        sandwich_norms=True,
        attn_softcap=float(caps["attn_logit_softcapping"] or 0.0),
        final_softcap=float(caps["final_logit_softcapping"] or 0.0),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
    )


def global_rope_params(raw: dict[str, Any], family: str) -> dict[str, Any] | None:
    """Gemma 3's full-attention layers' RoPE parameters when the config nests them per layer
    type (None: read the config's RoPE fields as every family does)."""
    nested = _nested_rope(raw, family)
    return None if nested is None else dict(nested.get("full_attention") or {})


def local_rope(raw: dict[str, Any], family: str, source: str | Path) -> RopeConfig | None:
    """Gemma 3's sliding layers' RoPE (None for other families: every layer shares one)."""
    if family != "gemma3":
        return None
    nested = _nested_rope(raw, family)
    if nested is not None:
        return parse_rope(raw, source, dict(nested.get("sliding_attention") or {}))
    theta = float(raw.get("rope_local_base_freq", 10000.0))
    return parse_rope(raw, source, {"rope_type": "default", "rope_theta": theta})


def _nested_rope(raw: dict[str, Any], family: str) -> dict[str, Any] | None:
    params = raw.get("rope_parameters")
    if family == "gemma3" and isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        return params
    return None
