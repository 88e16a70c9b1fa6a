"""The disk tier (`kv_offloading_backend="disk"`, `kv_offloading_path=DIR`): one file per
block, named by the block's chained hash (`_core.kv_block_file_name`), so the tier survives a
restart and engines on one machine share it (a prefix one replica computed is loaded by
another).

A file is a header then the block of every layer in the pool's slot layout: 8 magic bytes,
the header's length (4 bytes, little endian), the header as JSON (model identity, dtype, block
size, layout, the block's hash), the payload. A file is written under a temporary name and
renamed, so a visible file is complete. A load checks the header against this engine's and
the payload's length; a mismatched or truncated file is never loaded: it is reported as a
failed load (its tokens are computed again) with a warning.

`kv_offloading_size` bounds the directory: after a save, the least recently used files (by
modification time, which a load refreshes) are deleted until it fits.
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

from pagedllm._core import kv_block_file_name
from pagedllm.kv_transfer.worker import CopyThreadConnector, gather_blocks, scatter_blocks

logger = logging.getLogger("pagedllm")

MAGIC = b"PGKVBLK1"
_LENGTH = struct.Struct("<I")
SUFFIX = ".kvblock"


class DiskConnector(CopyThreadConnector):
    def __init__(
        self, kv_cache: torch.Tensor, directory: str, size_bytes: int, *, model: str
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
            "dtype": str(kv_cache.dtype),
            "block_size": int(kv_cache.shape[3]),
            "layout": "slot:[2,layers,block_size,kv_heads,head_dim]",
            "shape": list(self.block_shape),
        }

    def path_of(self, block_hash: int) -> Path:
        return self.directory / kv_block_file_name(block_hash)

    def _header(self, block_hash: int) -> bytes:
        header = json.dumps({**self.identity, "hash": block_hash}, sort_keys=True).encode()
        return MAGIC + _LENGTH.pack(len(header)) + header

    def _save(self, jobs, blocks, slots, hashes) -> list[int]:
        if not len(jobs):
            return []
        index = torch.from_numpy(np.ascontiguousarray(blocks)).to(self.device)
        data = gather_blocks(self.kv_cache, index).contiguous().cpu()
        for i, block_hash in enumerate(hashes.tolist()):
            path = self.path_of(block_hash)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(self._header(block_hash))
                    f.write(data[i].view(torch.uint8).numpy().tobytes())
                os.replace(tmp, path)
            except OSError as exc:  # a full disk loses the block, not the engine
                logger.warning("KV disk tier: could not save %s: %s", path, exc)
                tmp.unlink(missing_ok=True)
                continue
            self.bytes_saved += self.bytes_per_block
        self._evict()
        return list(dict.fromkeys(jobs.tolist()))

    def _read(self, block_hash: int) -> torch.Tensor | None:
        """The block stored under `block_hash`, or None (warned) when its file is missing,
        truncated or written by another model, dtype, block size or layout."""
        path = self.path_of(block_hash)
        try:
            raw = path.read_bytes()
            os.utime(path)  # recently used: evicted last
        except OSError as exc:
            logger.warning("KV disk tier: cannot read %s: %s", path, exc)
            return None
        expected = self._header(block_hash)
        if raw[: len(MAGIC)] != MAGIC:
            logger.warning("KV disk tier: ignoring %s: not a block file", path)
            return None
        if raw[: len(expected)] != expected:
            logger.warning(
                "KV disk tier: ignoring %s: written for another model, dtype, block size or "
                "layout (this engine writes %s)",
                path,
                self.identity,
            )
            return None
        payload = raw[len(expected) :]
        if len(payload) != self.bytes_per_block:
            logger.warning(
                "KV disk tier: ignoring %s: truncated (%d of %d payload bytes)",
                path,
                len(payload),
                self.bytes_per_block,
            )
            return None
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return data.view(self.kv_cache.dtype).reshape(self.block_shape)

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

    def _evict(self) -> None:
        """Deletes the least recently used block files until the directory fits its size."""
        entries = []
        total = 0
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(SUFFIX) and entry.is_file():
                    st = entry.stat()
                    entries.append((st.st_mtime, entry.path, st.st_size))
                    total += st.st_size
        if total <= self.size_bytes:
            return
        for _, path, size in sorted(entries):
            with contextlib.suppress(FileNotFoundError):  # another engine evicted it first
                os.unlink(path)
            total -= size
            if total <= self.size_bytes:
                break

    def stats(self) -> dict[str, float | int | list[int]]:
        return {**super().stats(), "kv_offload_disk_bytes_limit": self.size_bytes}
