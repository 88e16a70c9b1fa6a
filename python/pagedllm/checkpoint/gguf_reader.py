"""A GGUF file: its header parsed, its tensors views of the memory-mapped file until something
needs them in another form.

Every failure to read the file is a `GGUFError` naming the file and what is wrong with it, so
that a truncated download or a file of another kind never surfaces as a numpy traceback.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.checkpoint.errors import CheckpointError, CheckpointNotFoundError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read, or that describes a model pagedllm does not run."""


def is_gguf_path(model: str | Path) -> bool:
    """Whether `model` names a GGUF file (by its suffix; the file need not exist yet)."""
    return str(model).lower().endswith(GGUF_SUFFIX)


@dataclass(frozen=True)
class RawTensor:
    """One tensor of the file as stored: `data` is uint8 `[rows, row_bytes]` (a view of the
    mapped file), `shape` is `(rows, in_features)` for a matrix, `(n,)` for a vector."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.qtype)


def ggml_type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


# GGUF's value types (gguf.GGUFValueType): scalar ones as struct formats
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Little-endian reads over the file's header; running past its end is a GGUFError."""

    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.path, self.at = buffer, path, 0

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buffer):
            raise GGUFError(f"{self.path}: the header is cut short at byte {self.at} (truncated?)")
        value = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.unpack("Q")
        if self.at + length > len(self.buffer):
            raise GGUFError(f"{self.path}: a string runs past the end of the file (truncated?)")
        raw = bytes(self.buffer[self.at : self.at + length])
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise GGUFError(f"{self.path}: unknown metadata value type {kind} at byte {self.at}")

    def array(self) -> list:
        kind, count = self.unpack("I"), self.unpack("Q")
        if kind in _SCALARS and kind != 7:
            # numbers: one numpy read (vocabularies carry arrays of 10^5 scores and types)
            dtype = np.dtype("<" + _SCALARS[kind])
            end = self.at + count * dtype.itemsize
            if end > len(self.buffer):
                raise GGUFError(f"{self.path}: an array runs past the end of the file (truncated?)")
            values = np.frombuffer(self.buffer[self.at : end], dtype=dtype).tolist()
            self.at = end
            return values
        return [self.value(kind) for _ in range(count)]


class GGUFFile:
    """Metadata and tensors of one GGUF file (versions 2 and 3).

    The header is parsed here rather than with `gguf.GGUFReader`, which builds a numpy view per
    field and takes ~9 s over a 49k-token vocabulary (this reads it in well under a second);
    the `gguf` package still supplies the type tables. Tensors are views of the file mapped
    copy-on-write (torch warns on read-only arrays; nothing is written back)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"GGUF file {self.path} not found")
        self._check_magic()
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot map the file ({exc})") from None
        self.metadata, self._infos, data_start = self._parse_header()
        self._data_start = data_start

    def _check_magic(self) -> None:
        with self.path.open("rb") as handle:
            head = handle.read(4)
        if head != GGUF_MAGIC:
            raise GGUFError(
                f"{self.path}: not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})"
            )

    def _parse_header(
        self,
    ) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
        cursor = _Cursor(memoryview(self._map), self.path)
        cursor.at = len(GGUF_MAGIC)
        version = cursor.unpack("I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_values = cursor.unpack("Q"), cursor.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_values):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = cursor.unpack("I")
            if num_dims > 4:
                raise GGUFError(f"{self.path}: tensor {name!r} has {num_dims} dimensions")
            dims = tuple(cursor.unpack("Q") for _ in range(num_dims))
            qtype, offset = cursor.unpack("I"), cursor.unpack("Q")
            infos.append((name, dims, qtype, offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        return metadata, infos, -(-cursor.at // alignment) * alignment

    @cached_property
    def tensors(self) -> dict[str, RawTensor]:
        """Name -> the tensor as stored (matrix shapes in PyTorch order: rows first)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        table: dict[str, RawTensor] = {}
        for name, ggml_dims, qtype, offset in self._infos:
            dims = tuple(int(d) for d in reversed(ggml_dims))
            try:
                block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has unknown ggml type {qtype}"
                ) from None
            elements = int(np.prod(dims)) if dims else 1
            if dims and dims[-1] % block_elems:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} ({ggml_type_name(qtype)}) has rows of "
                    f"{dims[-1]} values, not a multiple of its block of {block_elems}"
                )
            nbytes = elements // block_elems * block_bytes
            start = self._data_start + offset
            if start + nbytes > len(self._map):
                raise GGUFError(
                    f"{self.path}: tensor {name!r} is cut short ({max(0, len(self._map) - start)}"
                    f" of {nbytes} bytes): the file is truncated"
                )
            rows = int(np.prod(dims[:-1])) if len(dims) > 1 else 1
            data = self._map[start : start + nbytes]
            table[name] = RawTensor(name=name, qtype=qtype, shape=dims, data=data.reshape(rows, -1))
        return table

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]


def open_gguf(path: str | Path) -> GGUFFile:
    """The file at `path`, opened once per process while it is unchanged (the `gguf` reader
    takes seconds over a large vocabulary, and the config, the tokenizer and the weights all
    read the same file)."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError:
        raise CheckpointNotFoundError(f"GGUF file {path} not found") from None
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size  # the cache key: a rewritten file is opened again
    return GGUFFile(path)
