"""Load a Llama / Qwen2 / Qwen3 checkpoint (or the built-in tiny model) for the engine.

Order of work, so that a bad checkpoint fails before any large allocation: parse config.json,
read the safetensors headers (names and shapes only), check every expected tensor, and only then
build the model on the meta device and stream each tensor to its device and dtype.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagedllm.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from pagedllm.checkpoint.gguf_reader import is_gguf_path
from pagedllm.config import DTYPE_NAMES, QUANTIZATIONS
from pagedllm.distributed.layers import PackableWeight, TPShard
from pagedllm.kernels import cpu_linear
from pagedllm.models import tiny_random
from pagedllm.models.config import ModelConfig, read_json, read_model_config
from pagedllm.models.decoder import DecoderForCausalLM
from pagedllm.models.fused_linear import SINGLE
from pagedllm.models.layout import checkpoint_layout, expected_shapes, shard_of
from pagedllm.models.moe import pack_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# name -> torch dtype of every dtype the models run in
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """ "auto"/None -> cuda when available, else cpu."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`"auto"`: float32 on CPU; on GPU the checkpoint's half dtype (bfloat16 if it states
    float32 or nothing)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float16, bfloat16 or float32")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        half = cfg.checkpoint_dtype in ("float16", "bfloat16")
        return TORCH_DTYPES[cfg.checkpoint_dtype] if half else torch.bfloat16
    if dtype not in TORCH_DTYPES:
        raise ValueError(
            f"dtype {dtype!r} is not supported; use 'auto', 'float16', 'bfloat16' or 'float32'"
        )
    return TORCH_DTYPES[dtype]


def load_model_config(model: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder, a GGUF file, a packaged model (`smollm2`) or the
    built-in `pagedllm/tiny-random`."""
    from pagedllm.models import gguf

    model = gguf.resolve_model(str(model))
    if model == tiny_random.MODEL_NAME:
        return tiny_random.tiny_random_config()
    if gguf.is_gguf_path(model):
        return gguf.read_gguf_config(model)
    return read_model_config(model)


def load_model(
    model: str | Path,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = "auto",
    tp: TPShard = SINGLE,
    pack_for_cpu: bool = False,
    quantization: str | None = None,
) -> DecoderForCausalLM:
    """Build the model of a checkpoint folder, a GGUF file (or `pagedllm/tiny-random`) on
    `device` in `dtype`.

    The returned module is in eval mode without gradients; its ModelConfig is `.config`. With a
    `tp` of more than one rank it is that rank's shard, and only its slices are read.
    `pack_for_cpu`: on the CPU, pack the linear layers' weights for the CPU kernel (what the
    engine runs; `kernels.cpu_linear`), dropping the unpacked copies; leave it off to read weights.
    `quantization` ("q8_0" | "q4_0", `QUANTIZATIONS`): quantize the linear layers at load
    (`quantize_linears`); GGUF weights keep their own types.
    """
    target = resolve_device(device)
    cfg = load_model_config(model)
    torch_dtype = resolve_dtype(dtype, cfg, target)
    check_quantization(quantization, cfg, target, torch_dtype)
    if cfg.path is None:
        if tp.size > 1:
            raise ValueError(f"{tiny_random.MODEL_NAME} cannot be sharded; use a checkpoint folder")
        built = tiny_random.build_tiny_random(cfg, device=target, dtype=torch_dtype)
    elif is_gguf_path(cfg.path):
        from pagedllm.models.gguf.weights import load_gguf_model

        built = load_gguf_model(cfg.path, cfg, device=target, dtype=torch_dtype, tp=tp)
    else:
        tensors = index_checkpoint(Path(cfg.path))
        check_checkpoint(cfg, tensors)
        built = _materialize(cfg, tensors, target, torch_dtype, tp)
    if quantization is not None:
        quantize_linears(built, QUANTIZATIONS[quantization])
    if pack_for_cpu:
        cpu_linear.pack_linears(built)
        pack_experts(built)
    return built


def check_quantization(
    quantization: str | None, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> None:
    """`quantization` is one of QUANTIZATIONS, for a safetensors checkpoint run on the CPU in
    float32 (where the quantized kernels run); ValueError naming what does not fit."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}"
        )
    if cfg.path is not None and is_gguf_path(cfg.path):
        raise ValueError(
            f"quantization={quantization!r} is for safetensors checkpoints; a GGUF file's "
            "weights keep the types they are stored in"
        )
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU in float32 (got {device}, {dtype})"
        )


def quantize_linears(model: torch.nn.Module, qtype: int) -> int:
    """Quantizes every linear layer's weight (`cpu_quant.quantize`: llama.cpp's rounding) into
    its `quant` slot and drops the float copy; the embedding stays in float (its rows are read,
    not multiplied), and so does a head tied to it. Returns how many were quantized."""
    from pagedllm.kernels import cpu_quant

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, PackableWeight) or weight is None or weight.dim() != 2:
            continue
        if module is getattr(model, "lm_head", None) and model.config.tie_word_embeddings:
            continue
        module.quant = cpu_quant.quantize(weight.detach().float().contiguous(), qtype)
        module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
        count += 1
    return count


def index_checkpoint(folder: Path) -> dict[str, TensorInfo]:
    """Name -> (file, shape) of every tensor in the folder's safetensors files (headers only)."""
    files = _weight_files(folder)
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    tensors[name] = TensorInfo(file, tuple(handle.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: cannot read safetensors header ({exc})") from exc
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty field 'weight_map'")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointNotFoundError(f"{file}: listed in {INDEX_FILE} but not found")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(
            f"{folder}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE} with its shards)"
        )
    return files


def check_checkpoint(cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the config implies must be present with its shape; extra tensors are ignored."""
    for name, shape in expected_shapes(cfg).items():
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(f"{cfg.path}: missing tensor '{name}' in the safetensors files")
        if info.shape != shape:
            raise CheckpointError(
                f"{info.file}: tensor '{name}' has shape {list(info.shape)}, "
                f"config implies {list(shape)}"
            )


def _read_slice(handle, name: str, shard: tuple[int, slice] | None) -> torch.Tensor:
    """Reads only `shard` of the tensor from the file (zero rows past its end: vocab padding)."""
    if shard is None:
        return handle.get_tensor(name)
    axis, rows = shard
    view = handle.get_slice(name)
    length = view.get_shape()[axis]
    stop = max(rows.start, min(rows.stop, length))
    part = view[rows.start : stop] if axis == 0 else view[:, rows.start : stop]
    missing = rows.stop - stop
    if missing > 0:
        pad = torch.zeros((missing, *part.shape[1:]), dtype=part.dtype, device=part.device)
        part = torch.cat([part, pad])
    return part


def _materialize(
    cfg: ModelConfig,
    tensors: dict[str, TensorInfo],
    device: torch.device,
    dtype: torch.dtype,
    tp: TPShard = SINGLE,
) -> DecoderForCausalLM:
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, tp)
    state = {}
    with ExitStack() as open_files:
        handles: dict[Path, Any] = {}

        def read(name: str) -> torch.Tensor:
            # each file is opened once; tensors are read straight onto the target device
            file = tensors[name].file
            if file not in handles:
                handles[file] = open_files.enter_context(
                    safe_open(file, framework="pt", device=str(device))
                )
            return _read_slice(handles[file], name, shard_of(cfg, name, tp)).to(dtype)

        for param, sources in checkpoint_layout(cfg).items():
            parts = [read(name) for name in sources]
            state[param] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.reset_rotary()
    return model.requires_grad_(False).eval()
