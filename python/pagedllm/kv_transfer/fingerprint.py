"""What a disk tier's block file says about the model that computed it, beyond its path: a
fingerprint of the weights and the config (the KV of a prefix depends on them) and of the
tokenizer. Cheap: the weights are never read whole.

- a checkpoint folder: `config.json`, the safetensors index and the tokenizer files whole;
  each weights file (`*.safetensors`, `*.gguf`) by its size, its header (safetensors: its JSON
  header; otherwise the first `HEAD_BYTES`, where a GGUF file keeps its metadata, tokenizer
  included) and `SAMPLES` samples of `SAMPLE_BYTES` spread over the rest. New weights at the
  same path differ in almost every sample even where the headers and sizes are identical (a
  fine-tune of the same architecture).
- a single file (a `.gguf`, or a packaged model's, `smollm2`): the same, that file being
  model and tokenizer.
- the built-in `pagedllm/tiny-random`: the code that draws its seeded weights, and torch's
  version (its random generator).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import xxhash

from pagedllm.config import TINY_RANDOM_MODEL

SAMPLES = 64
SAMPLE_BYTES = 4096
HEAD_BYTES = 16 << 20
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
_U64 = struct.Struct("<Q")


def model_fingerprint(model: str, tokenizer: str | None = None) -> str:
    """The fingerprint (hex) of `model` (a checkpoint folder, a single weights file or the
    built-in model) and of `tokenizer` when it is somewhere else."""
    digest = xxhash.xxh3_128()
    _add_source(digest, str(model), weights=True)
    if tokenizer is not None and str(tokenizer) != str(model):
        _add_source(digest, str(tokenizer), weights=False)
    return digest.hexdigest()


def _add_source(digest, source: str, *, weights: bool) -> None:
    from pagedllm.checkpoint.packaged import resolve_model

    source = resolve_model(source)  # a packaged model's short name: its file
    path = Path(source)
    if source == TINY_RANDOM_MODEL:
        import torch

        from pagedllm.models import tiny_random

        _add(digest, source, Path(tiny_random.__file__).read_bytes())
        _add(digest, "torch", torch.__version__.encode())
    elif path.is_dir():
        for child in sorted(path.iterdir()):
            if child.is_file() and _fingerprinted(child.name, weights=weights):
                _add(digest, child.name, file_digest(child))
    elif path.is_file():
        _add(digest, path.name, file_digest(path))
    else:  # nothing on disk by that name: its name is all there is
        _add(digest, "name", source.encode())


def _fingerprinted(name: str, *, weights: bool) -> bool:
    """Whether a folder's file `name` is part of the fingerprint (the tokenizer's files always;
    the config and the weights when the folder is the model's)."""
    if name.startswith("tokenizer") or name in TOKENIZER_FILES:
        return True
    return weights and (
        name in MODEL_FILES or name.endswith(".index.json") or name.endswith(WEIGHT_SUFFIXES)
    )


def _add(digest, label: str, data: bytes) -> None:
    """Length-prefixed, so that no two different (label, data) sequences hash alike."""
    for part in (label.encode(), data):
        digest.update(_U64.pack(len(part)))
        digest.update(part)


def file_digest(path: Path) -> bytes:
    """A file's size, its header region and `SAMPLES` samples of the rest (all of it when
    small), hashed."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(_U64.pack(size))
        head = _head_bytes(f, path.suffix, size)
        f.seek(0)
        digest.update(f.read(head))
        rest = size - head
        if rest <= SAMPLES * SAMPLE_BYTES:
            digest.update(f.read(rest))
        else:
            span = rest - SAMPLE_BYTES
            for i in range(SAMPLES):
                f.seek(head + span * i // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.digest()


def _head_bytes(f: BinaryIO, suffix: str, size: int) -> int:
    """The length of a file's header region: a safetensors file's 8-byte length and JSON
    header, else the first `HEAD_BYTES` (never more than either bound, nor than the file)."""
    if suffix == ".safetensors" and size >= _U64.size:
        (length,) = _U64.unpack(f.read(_U64.size))
        return min(size, _U64.size + min(length, HEAD_BYTES))
    return min(size, HEAD_BYTES)
