"""The disk tier (`kv_offloading_backend="disk"`, `kv_offloading_path=DIR`): one file per
block, named by the block's chained hash (`_core.kv_block_file_name`), so the tier survives a
restart and engines on one machine share it (a prefix one replica computed is loaded by
another).

A file is a header, a checksum, then the block of every layer in the pool's slot layout: 8
magic bytes, the header's length (4 bytes, little endian), the header as JSON (the model's
identity: its path, its weights' and tokenizer's fingerprint (`fingerprint.py`), its
quantization at load; dtype, row format, a quantized cache's key calibration digest, block
size, layout, the block's hash), the payload's xxh3-64 (8 bytes, little endian), the payload.
A file is written under a temporary name and renamed, so a visible file is complete.

A load reads no more than a header before it knows the file's size (from its metadata), then
checks the header against this engine's, the size, and the payload against its checksum,
before anything is copied. A file that fails is never loaded: it is a failed load (its
tokens are computed again) with a warning; one whose payload fails its checksum is also
deleted and counted (`kv_offload_disk_corrupt_blocks`).

The tier degrades rather than fail a request: an OS error (a folder deleted, read-only,
full) loses the blocks it concerns (saves are dropped, loads computed again), is counted
(`kv_offload_disk_io_errors`) and warned of once. A deleted folder is made again at the next
save. A read-only folder still serves loads.

`kv_offloading_size` bounds the directory: after a save, the least recently used files (by
modification time, which a load refreshes where it can) are deleted until it fits; a file
another engine deleted first is skipped. Their hashes go to the scheduler's side (with the
finished transfers: `get_finished`), which publishes them removed (KV events, medium `STORAGE`:
`rust/src/connector/disk.rs`) without listing the directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import uuid
from pathlib import Path

import numpy as np
import torch
import xxhash

from pagedllm._core import kv_block_file_name
from pagedllm.kernels.reference import kv_row_format
from pagedllm.kv_transfer.fingerprint import model_fingerprint
from pagedllm.kv_transfer.worker import CopyThreadConnector, gather_blocks, scatter_blocks

logger = logging.getLogger("pagedllm")

MAGIC = b"PGKVBLK2"
_LENGTH = struct.Struct("<I")
_CHECKSUM = struct.Struct("<Q")  # xxh3-64 of the payload
SUFFIX = ".kvblock"


class DiskConnector(CopyThreadConnector):
    def __init__(
        self,
        kv_cache: torch.Tensor,
        directory: str,
        size_bytes: int,
        *,
        model: str,
        tokenizer: str | None = None,
        quantization: str | None = None,
        key_calibration: str | None = None,
    ) -> None:
        super().__init__(kv_cache)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.size_bytes = size_bytes
        self.block_shape = (2, kv_cache.shape[1], *kv_cache.shape[3:])
        element = kv_cache.element_size()
        self.bytes_per_block = element * int(torch.Size(self.block_shape).numel())
        # what every file of this engine says, and every file it loads must say
        self.identity = {
            "model": model,
            "fingerprint": model_fingerprint(model, tokenizer),
            "quantization": quantization,  # weights quantized at load compute other KV
            "dtype": str(kv_cache.dtype),
            # a quantized cache's row format (rotation, scale coding): an earlier layout's
            # blocks of the same dtype are refused too
            "rows": kv_row_format(kv_cache.dtype),
            # a quantized cache's key transform (`worker/kv_calibration.py`): its digest, as
            # keys stored under another calibration (or none) are other numbers
            "key_calibration": key_calibration,
            "block_size": int(kv_cache.shape[3]),
            "layout": "slot:[2,layers,block_size,kv_heads,head_dim]",
            "shape": list(self.block_shape),
        }
        # the tier's failures, for the metrics: OS errors, and files whose payload failed its
        # checksum (deleted)
        self.io_errors = 0
        self.corrupt_blocks = 0
        self._warned_io = False

    def path_of(self, block_hash: int) -> Path:
        return self.directory / kv_block_file_name(block_hash)

    def _header(self, block_hash: int) -> bytes:
        header = json.dumps({**self.identity, "hash": block_hash}, sort_keys=True).encode()
        return MAGIC + _LENGTH.pack(len(header)) + header

    def file_bytes(self, block_hash: int) -> int:
        """The size of the file of block `block_hash`."""
        return len(self._header(block_hash)) + _CHECKSUM.size + self.bytes_per_block

    def _io_error(self, action: str, path: Path | str, exc: OSError) -> None:
        """Counts an OS error of the tier; only the first is warned of (a read-only or deleted
        folder would otherwise log every block)."""
        self.io_errors += 1
        if self._warned_io:
            logger.debug("KV disk tier: cannot %s %s: %s", action, path, exc)
            return
        self._warned_io = True
        logger.warning(
            "KV disk tier: cannot %s %s: %s; the tier degrades: blocks it cannot save or "
            "load are computed again (further errors are counted in "
            "pagedllm:kv_offload_disk_errors, not logged)",
            action,
            path,
            exc,
        )

    # ---- saves --------------------------------------------------------------------------

    def _save(self, jobs, blocks, slots, hashes) -> list[int]:
        if not len(jobs):
            return []
        index = torch.from_numpy(np.ascontiguousarray(blocks)).to(self.device)
        data = gather_blocks(self.kv_cache, index).contiguous().cpu()
        if self._make_directory():
            for i, block_hash in enumerate(hashes.tolist()):
                if self._write(block_hash, data[i]):
                    self.bytes_saved += self.bytes_per_block
            self._evict()
        return list(dict.fromkeys(jobs.tolist()))

    def _make_directory(self) -> bool:
        """Whether the folder is there, made again if it was deleted."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._io_error("create", self.directory, exc)
            return False
        return True

    def _write(self, block_hash: int, block: torch.Tensor) -> bool:
        """Writes one block's file; False (counted) when the OS refuses (the block is lost)."""
        path = self.path_of(block_hash)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        payload = block.view(torch.uint8).numpy()
        try:
            with open(tmp, "wb") as f:
                f.write(self._header(block_hash))
                f.write(_CHECKSUM.pack(xxhash.xxh3_64_intdigest(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            self._io_error("save", path, exc)
            with contextlib.suppress(OSError):  # never written, or the folder is read-only
                os.unlink(tmp)
            return False
        return True

    def _evict(self) -> None:
        """Deletes the least recently used block files until the directory fits its size."""
        entries = []
        total = 0
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if not entry.name.endswith(SUFFIX):
                        continue
                    try:
                        if not entry.is_file():
                            continue
                        st = entry.stat()
                    except FileNotFoundError:  # another engine evicted it since the listing
                        continue
                    entries.append((st.st_mtime, entry.path, st.st_size))
                    total += st.st_size
        except OSError as exc:
            self._io_error("list", self.directory, exc)
            return
        if total <= self.size_bytes:
            return
        removed = []
        try:
            for _, path, size in sorted(entries):
                try:
                    os.unlink(path)
                except FileNotFoundError:  # another engine evicted it first
                    pass
                except OSError as exc:  # read-only: so would every other deletion be
                    self._io_error("evict", path, exc)
                    return
                removed.append(int(os.path.basename(path).removesuffix(SUFFIX), 16))
                total -= size
                if total <= self.size_bytes:
                    break
        finally:
            with self._lock:  # for the scheduler, which publishes them removed
                self._removed.extend(removed)

    # ---- loads --------------------------------------------------------------------------

    def _read(self, block_hash: int) -> torch.Tensor | None:
        """The block stored under `block_hash`, or None when its file is missing, is not this
        engine's (another model, dtype, block size or layout), has the wrong size or fails
        its checksum (warned, except a file evicted since it matched)."""
        path = self.path_of(block_hash)
        try:
            with open(path, "rb") as f:
                return self._read_block(f, path, block_hash)
        except FileNotFoundError:  # evicted since the scheduler found it (here or elsewhere)
            logger.debug("KV disk tier: %s is gone", path)
        except OSError as exc:
            self._io_error("read", path, exc)
        return None

    def _read_block(self, f, path: Path, block_hash: int) -> torch.Tensor | None:
        expected = self._header(block_hash)
        size = os.fstat(f.fileno()).st_size
        head = f.read(min(size, len(expected)))
        if head[: len(MAGIC)] != MAGIC:
            logger.warning("KV disk tier: ignoring %s: not a block file", path)
            return None
        if head != expected:
            logger.warning(
                "KV disk tier: ignoring %s: written for another model, dtype, block size or "
                "layout (this engine writes %s)",
                path,
                self.identity,
            )
            return None
        want = len(expected) + _CHECKSUM.size + self.bytes_per_block
        if size != want:  # checked before the payload is read: an oversized file never is
            logger.warning(
                "KV disk tier: ignoring %s: %d bytes where a block file has %d (truncated or "
                "oversized)",
                path,
                size,
                want,
            )
            return None
        (checksum,) = _CHECKSUM.unpack(f.read(_CHECKSUM.size))
        payload = bytearray(self.bytes_per_block)
        if f.readinto(payload) != self.bytes_per_block:
            logger.warning("KV disk tier: ignoring %s: truncated while read", path)
            return None
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            self._discard_corrupt(path)
            return None
        with contextlib.suppress(OSError):  # recently used: evicted last (where writable)
            os.utime(f.fileno())
        data = torch.frombuffer(payload, dtype=torch.uint8)
        return data.view(self.kv_cache.dtype).reshape(self.block_shape)

    def _discard_corrupt(self, path: Path) -> None:
        """A payload that fails its checksum: counted, and its file deleted (a later save
        writes the block again)."""
        self.corrupt_blocks += 1
        logger.warning(
            "KV disk tier: ignoring %s: its payload fails its checksum (corrupted); deleted", path
        )
        with contextlib.suppress(OSError):  # gone already, or the folder is read-only
            os.unlink(path)

    def _load(self, jobs, blocks, slots, hashes) -> tuple[list[int], list[int]]:
        if not len(jobs):
            return [], []
        good_blocks, good_data, invalid = [], [], []
        for block, block_hash in zip(blocks.tolist(), hashes.tolist()):
            data = self._read(block_hash)
            if data is None:
                invalid.append(block)
            else:
                good_blocks.append(block)
                good_data.append(data)
        if good_blocks:
            index = torch.tensor(good_blocks, dtype=torch.int64, device=self.device)
            scatter_blocks(self.kv_cache, index, torch.stack(good_data).to(self.device))
            self.bytes_loaded += len(good_blocks) * self.bytes_per_block
        return list(dict.fromkeys(jobs.tolist())), invalid

    def stats(self) -> dict[str, float | int | list[int]]:
        return {
            **super().stats(),
            "kv_offload_disk_bytes_limit": self.size_bytes,
            "kv_offload_disk_io_errors": self.io_errors,
            "kv_offload_disk_corrupt_blocks": self.corrupt_blocks,
        }
