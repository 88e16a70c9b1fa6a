"""Rotary embedding parameters from a config.json and the inverse frequencies they give, as
`transformers`' `modeling_rope_utils` computes them: `default`, `linear`, `llama3`, `yarn`,
`dynamic` (NTK) and `longrope`.

Cached keys are never re-rotated, so the engine follows vLLM's static rule: every table is
computed once from the config for the longest context the scaling covers, whatever the current
length. `dynamic` uses the base NTK gives at that length (`factor` x `max_position_embeddings`)
and `longrope` its long factors whenever `max_position_embeddings` exceeds
`original_max_position_embeddings` (short ones otherwise). `transformers` instead recomputes
both per forward from that forward's length, so the two agree on one unchunked forward of that
length (dynamic) or longer than the original context (longrope), not token for token on shorter
ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pagedllm.checkpoint.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: the factor on cos/sin (None: derived from `factor` as transformers does)
    attention_factor: float | None = None
    # longrope: one factor per rotated pair
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # the model's max_position_embeddings where the tables depend on it (dynamic, longrope)
    max_positions: int = 0

    @property
    def longest_context(self) -> int:
        """The longest context these tables cover (max_model_len may not exceed it)."""
        native = self.max_positions
        if self.rope_type in ("linear", "dynamic"):
            return int(native * self.factor)
        if self.rope_type in ("llama3", "yarn"):
            return max(native, int(self.original_max_position_embeddings * self.factor))
        return native


def parse_rope(
    raw: dict[str, Any], source: str | Path = "config.json", params: dict | None = None
) -> RopeConfig:
    """Read RoPE parameters from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`;
    `params`: an explicit parameter dict (Gemma 3's per-layer-type ones)."""
    if params is not None:
        field_name = "rope_parameters"
    elif isinstance(raw.get("rope_parameters"), dict):
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
    missing = [name for name in _REQUIRED.get(rope_type, ()) if params.get(name) is None]
    if missing:
        raise CheckpointError(
            f"{source}: field '{field_name}' lacks {missing} for rope_type {rope_type!r}"
        )
    max_positions = int(raw.get("max_position_embeddings") or 0)
    original = int(params.get("original_max_position_embeddings") or 8192)
    factor = params.get("factor")
    if factor is None:  # longrope (Phi-3): the ratio of the two lengths
        factor = max_positions / original if rope_type == "longrope" else 1.0
    optional = {
        name: float(params[name])
        for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor")
        if params.get(name)
    }
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=original,
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        # only where the tables depend on it (configs of other types compare equal without it)
        max_positions=max_positions if rope_type in ("dynamic", "longrope") else 0,
        **optional,
    )


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> tuple[Tensor, float]:
    """Inverse frequencies `[head_dim / 2]` (float32) and the factor on cos/sin (1 but for
    yarn and longrope), for the longest context the scaling covers (module docstring)."""
    # on the CPU even while the model is built on the meta device: arithmetic on meta tensors
    # imports torch._dynamo, seconds of start-up (`reset_rotary` moves the table)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    theta = rope.theta
    if rope.rope_type == "dynamic":
        # NTK at the longest covered length: factor * max_positions
        theta *= (rope.factor * rope.factor - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
    pos_freqs = theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(pos_freqs, head_dim, rope)
    if rope.rope_type == "longrope":
        return _longrope(exponents, head_dim, rope)
    return inv_freq, 1.0


def _llama3_scaled(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated linearly in (original context / wavelength).
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(pos_freqs: Tensor, dim: int, rope: RopeConfig) -> tuple[Tensor, float]:
    # YaRN: dimensions that turn fewer than beta_slow times over the original context are
    # interpolated (slowed by `factor`), more than beta_fast times kept, a linear ramp between;
    # cos/sin grow by the attention factor
    factor, base = rope.factor, rope.theta
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention = _yarn_mscale(factor)

    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp
    interpolated = 1.0 / (factor * pos_freqs)
    kept = 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + kept * extrapolation, float(attention)


def _longrope(exponents: Tensor, dim: int, rope: RopeConfig) -> tuple[Tensor, float]:
    # LongRoPE (Phi-3): per-pair factors, the long ones when the model's context exceeds the
    # original one (the static rule of the module docstring)
    original = rope.original_max_position_embeddings
    long = rope.max_positions > original
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != dim // 2:
        name = "long_factor" if long else "short_factor"
        raise CheckpointError(
            f"config.json: field 'rope_scaling.{name}' has {len(factors)} entries, the head "
            f"size {dim} needs {dim // 2}"
        )
    attention = rope.attention_factor
    if attention is None:
        factor = rope.factor
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * rope.theta**exponents), float(attention)
