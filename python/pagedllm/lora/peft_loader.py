"""Reading a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into a
`LoRAAdapter`, checked against the model before any request uses it.

Every problem is a ValueError naming the adapter, its folder and what is wrong: a missing or
unreadable folder or file, a malformed config, a rank above `max_lora_rank`, a projection the
model does not have (or that we do not adapt: embeddings, `lm_head`), a matrix whose shape does
not fit the model or that holds NaN or infinite values (in the model's dtype, after scaling), or
a PEFT option whose effect we would silently drop (DoRA, biases, `modules_to_save`, per-module
ranks).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pagedllm.lora.adapter import PROJECTIONS, LoRAAdapter, ModelLoRASpec
from pagedllm.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter name)
_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$"
)
# PEFT options that change what the adapter computes beyond A/B/scaling: refused, not ignored
_UNSUPPORTED = (
    "use_dora",
    "modules_to_save",
    "lora_bias",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "use_qalora",
    "alora_invocation_tokens",
)


class _Problem(ValueError):
    pass


def load_peft_adapter(
    request: LoRARequest, spec: ModelLoRASpec, max_lora_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """The adapter of `request`, validated against `spec`, its tensors in `dtype` on the CPU."""
    try:
        folder = Path(request.lora_path)
        if not folder.is_dir():
            raise _Problem("no such folder")
        config = _read_config(folder / CONFIG_FILE)
        rank, scaling = _rank_and_scaling(config, max_lora_rank)
        _check_targets(config.get("target_modules"))
        weights = _read_weights(folder, spec, rank, scaling, dtype)
    except _Problem as exc:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r} (lora_int_id={request.lora_int_id}, "
            f"{request.lora_path}): {exc}"
        ) from None
    return LoRAAdapter(
        name=request.lora_name,
        lora_int_id=request.lora_int_id,
        path=request.lora_path,
        rank=rank,
        scaling=scaling,
        weights=weights,
    )


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise _Problem(f"no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Problem(f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _Problem(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _Problem(f"peft_type {peft_type!r} is not LoRA")
    for option in _UNSUPPORTED:
        if config.get(option):
            raise _Problem(f"{option}={config[option]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise _Problem(f"bias={config['bias']!r} is not supported (only 'none')")
    return config


def _rank_and_scaling(config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _Problem(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise _Problem(f"rank r={rank} exceeds max_lora_rank={max_lora_rank}")
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _Problem(f"lora_alpha must be a number, got {alpha!r}")
    # as PEFT scales: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _check_targets(targets: Any) -> None:
    if targets is None or isinstance(targets, str):
        return  # a regex or "all-linear": the weights say which projections it matched
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _Problem(f"target_modules must be a list of names, got {targets!r}")
    unknown = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in PROJECTIONS})
    if unknown:
        raise _Problem(
            f"target modules {unknown} are not projections of this model "
            f"(LoRA applies to {', '.join(PROJECTIONS)})"
        )


def _read_weights(
    folder: Path, spec: ModelLoRASpec, rank: int, scaling: float, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        bin_only = (folder / "adapter_model.bin").exists()
        hint = " (adapter_model.bin is not read: save with safetensors)" if bin_only else ""
        raise _Problem(f"no {WEIGHTS_FILE}{hint}")
    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise _Problem(f"{WEIGHTS_FILE} is not readable: {exc}") from None
    # (layer, projection) -> "A" / "B" -> (weight name, matrix)
    halves: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _Problem(f"weight {key!r} is not a LoRA A/B matrix of a decoder projection")
        layer, module, half = int(match[1]), match[3], match[4]
        if module not in PROJECTIONS:
            raise _Problem(
                f"target module {module!r} (weight {key!r}) is not a projection this model "
                f"adapts ({', '.join(PROJECTIONS)})"
            )
        if layer >= spec.num_layers:
            raise _Problem(f"weight {key!r}: the model has {spec.num_layers} layers")
        halves.setdefault((layer, module), {})[half] = (key, tensor)
    if not halves:
        raise _Problem(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise _Problem(f"{where}: lora_A and lora_B must both be present")
        (a_key, a), (b_key, b) = pair["A"], pair["B"]
        d_in, d_out = spec.shapes[module]
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
            raise _Problem(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank "
                f"{rank} and the model's {d_in} -> {d_out} projection"
            )
        a_used, b_used = a.to(dtype), (b.float() * scaling).to(dtype)
        _check_finite(a_key, a, a_used, dtype, 1.0)
        _check_finite(b_key, b, b_used, dtype, scaling)
        weights[(layer, module)] = (a_used, b_used)
    return weights


def _check_finite(
    key: str, raw: torch.Tensor, used: torch.Tensor, dtype: torch.dtype, scaling: float
) -> None:
    """A NaN or infinite weight (or one the scaling and `dtype` overflow) makes every logit of
    the adapter's requests NaN: refused at load instead of sampling garbage."""
    if torch.isfinite(used).all():
        return
    if not torch.isfinite(raw).all():
        raise _Problem(f"weight {key!r} holds NaN or infinite values")
    raise _Problem(
        f"weight {key!r} overflows {str(dtype).removeprefix('torch.')} once scaled by "
        f"{scaling:g} (values too large for the model's dtype)"
    )
