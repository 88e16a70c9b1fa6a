"""A GGUF file opened through the `gguf` package's reader (memory-mapped: tensors are views of
the file until something needs them in another form).

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

from pagedllm.models.errors import CheckpointError, CheckpointNotFoundError

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


class GGUFFile:
    """Metadata and tensors of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"GGUF file {self.path} not found")
        self._check_magic()
        import gguf

        try:
            # copy-on-write: the arrays are writable views (torch warns on read-only ones);
            # nothing is written back to the file
            self._reader = gguf.GGUFReader(self.path, "c")
        except (ValueError, KeyError, IndexError, OverflowError, struct.error) as exc:
            raise GGUFError(
                f"{self.path}: cannot read the GGUF file (truncated or corrupt?): {exc}"
            ) from None

    def _check_magic(self) -> None:
        with self.path.open("rb") as handle:
            head = handle.read(4)
        if head != GGUF_MAGIC:
            raise GGUFError(
                f"{self.path}: not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})"
            )

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key-value pair, decoded (arrays as lists)."""
        values: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                values[name] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                raise GGUFError(
                    f"{self.path}: metadata key {name!r} is malformed ({exc})"
                ) from None
        return values

    @cached_property
    def tensors(self) -> dict[str, RawTensor]:
        """Name -> the tensor as stored (matrix shapes in PyTorch order: rows first)."""
        table: dict[str, RawTensor] = {}
        for tensor in self._reader.tensors:
            dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            data = np.asarray(tensor.data)
            if data.nbytes != int(tensor.n_bytes):
                raise GGUFError(
                    f"{self.path}: tensor {tensor.name!r} is cut short ({data.nbytes} of "
                    f"{int(tensor.n_bytes)} bytes): the file is truncated"
                )
            rows = int(np.prod(dims[:-1])) if len(dims) > 1 else 1
            table[tensor.name] = RawTensor(
                name=tensor.name,
                qtype=int(tensor.tensor_type),
                shape=dims,
                data=data.reshape(-1).view(np.uint8).reshape(rows, -1),
            )
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
