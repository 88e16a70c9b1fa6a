"""GGUF checkpoints (llama.cpp's single-file format): `model="path/model.gguf"`.

`gguf_model_config(file)` reads the metadata into a ModelConfig, `load_gguf_model` builds the
decoder with quantized weights kept in their type (`weights.py`). The file format itself, the
tokenizer and chat template the file carries, and the packaged models (`smollm2`, a GGUF file
found by a short name) are read without torch, in `pagedllm.checkpoint`.
"""

from pagedllm.checkpoint.gguf_reader import GGUFError, GGUFFile, is_gguf_path, open_gguf
from pagedllm.checkpoint.packaged import PACKAGED_MODELS, packaged_model_path, resolve_model

__all__ = [
    "PACKAGED_MODELS",
    "GGUFError",
    "GGUFFile",
    "is_gguf_path",
    "packaged_model_path",
    "read_gguf_config",
    "resolve_model",
    "served_model_name",
]


def read_gguf_config(path):
    """The ModelConfig of a GGUF file (metadata and tensor table only: cheap)."""
    from pagedllm.models.gguf.config import gguf_model_config

    return gguf_model_config(open_gguf(path))


def served_model_name(model: str) -> str:
    """The name a server answers to by default: a GGUF file's own name, else `model`."""
    from pathlib import Path

    return Path(model).name if is_gguf_path(model) else model
