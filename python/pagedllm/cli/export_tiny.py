"""`pagedllm export-tiny`: the built-in tiny model as files a new user can point `--model`,
LoRA and draft models at, without a download.

It sits with the command (the top layer) because it writes both a checkpoint (`models`) and a
LoRA adapter for it (`lora`'s file format and projection shapes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from pagedllm.lora.adapter import ModelLoRASpec
from pagedllm.lora.peft_loader import CONFIG_FILE, WEIGHTS_FILE
from pagedllm.models.config import ModelConfig
from pagedllm.models.hf_export import save_checkpoint
from pagedllm.models.layout import checkpoint_layout
from pagedllm.models.tiny_random import (
    DEFAULT_SEED,
    build_tiny_random,
    save_byte_tokenizer,
    tiny_random_config,
)


def export_tiny(
    folder: str | Path,
    *,
    family: str = "llama",
    num_layers: int | None = None,
    with_adapter: bool = False,
    seed: int = DEFAULT_SEED,
) -> dict[str, Path]:
    """The tiny model as a checkpoint folder (config, safetensors, byte tokenizer): the llama
    family with the default seed is `pagedllm/tiny-random` itself. `num_layers` keeps the first
    layers only (a draft model for the full one); `with_adapter` also writes a random PEFT LoRA
    adapter in `folder/adapter`. Returns {"model": folder, "adapter": ...}."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} already exists and is not an empty folder")
    cfg = tiny_random_config(family)
    model = build_tiny_random(cfg, seed=seed)
    save_checkpoint(model, folder, num_layers=num_layers)
    save_byte_tokenizer(folder)
    written = {"model": folder}
    if with_adapter:
        kept = dataclasses.replace(cfg, num_layers=num_layers or cfg.num_layers, path=str(folder))
        written["adapter"] = save_random_lora_adapter(folder / "adapter", kept, seed=seed + 1)
    return written


def save_random_lora_adapter(
    folder: str | Path,
    cfg: ModelConfig,
    *,
    rank: int = 8,
    lora_alpha: int = 16,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> Path:
    """A PEFT LoRA adapter for a model of `cfg` with seeded random A and B (an untrained
    adapter large enough to change greedy tokens): `adapter_config.json` and
    `adapter_model.safetensors` as PEFT writes them. Needs no `peft`."""
    from safetensors.torch import save_file

    shapes = ModelLoRASpec.of(cfg).shapes
    unknown = sorted(set(target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"target_modules {unknown} are not projections LoRA adapts")
    # the checkpoint's name of each adapted weight: PEFT prefixes it with base_model.model.
    targets = [
        (name.removesuffix(".weight"), shapes[module])
        for name in sorted({src for srcs in checkpoint_layout(cfg).values() for src in srcs})
        for module in target_modules
        if name.startswith("model.layers.") and name.endswith(f".{module}.weight")
    ]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (d_in, d_out) in targets:
        a = torch.randn(rank, d_in, generator=generator) / math.sqrt(d_in)
        b = torch.randn(d_out, rank, generator=generator) / math.sqrt(rank)
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.path,
        "r": rank,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_rslora": False,
        "inference_mode": True,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder
