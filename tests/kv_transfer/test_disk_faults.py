"""The disk KV tier under faults: a replaced model's files are never loaded, a corrupted
payload is recomputed (counted, its file deleted), an oversized file is rejected from its size
without being read, and a deleted or read-only folder, another engine's evictions or a save
that raises never fail a request nor keep a block."""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import shutil
import tracemalloc

import numpy as np
import pytest
import torch
from kv_transfer_util import block_files, generate, make_disk_llm, make_plain_llm, prompt

from pagedllm._core import hash_block_chain, kv_block_file_name
from pagedllm.cli.export_tiny import export_tiny
from pagedllm.entrypoints.metrics import _offload_metrics
from pagedllm.kv_transfer import DiskConnector, disk


@pytest.fixture(scope="module")
def reference():
    return generate(make_plain_llm(), prompt() + [9])


def sixth_block_file(tier):
    return tier / kv_block_file_name(hash_block_chain(prompt(), 4)[5])


def drained(llm) -> None:
    """Every transfer reported and every device block free."""
    engine = llm.llm_engine
    stats = engine.scheduler.get_stats()
    assert not engine.scheduler.has_pending_transfers()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    engine.scheduler.check_invariants()


def read_only(monkeypatch) -> None:
    """A read-only mount as the tier sees it: whatever would write raises EROFS. Simulated
    (tests run as root, whom chmod does not stop, and cannot count on mounting): the os
    functions the tier writes with, and its `open` for writing."""

    def refuse(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkdir(path, *args, **kwargs):
        if os.path.exists(path):  # as the kernel: an existing name is EEXIST first
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        refuse(path)

    def open_for_reading(file, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            refuse(file)
        return builtins.open(file, mode, *args, **kwargs)

    for name in ("replace", "rename", "unlink", "utime"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(disk, "open", open_for_reading, raising=False)


# ---- the model's identity ---------------------------------------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny model exported with two seeds: same shapes, other weights."""
    root = tmp_path_factory.mktemp("exports")
    return [export_tiny(root / f"seed{seed}", seed=seed)["model"] for seed in (0, 1)]


def test_new_weights_at_the_same_path_load_nothing_from_the_old_files(tmp_path, exports):
    model = shutil.copytree(exports[0], tmp_path / "model")
    tier = tmp_path / "tier"
    first = make_disk_llm(tier, model=str(model))
    generate(first, prompt())
    first.llm_engine.shutdown()
    # new weights at the same path (same shapes: the safetensors headers are identical)
    shutil.copyfile(exports[1] / "model.safetensors", model / "model.safetensors")
    want = generate(make_plain_llm(model=str(exports[1])), prompt() + [9])
    out = generate(make_disk_llm(tier, model=str(model)), prompt() + [9])
    assert out.metrics.num_offloaded_cached_tokens == 0
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_files_of_a_model_are_not_loaded_by_its_run_quantized_at_load(tmp_path, exports):
    # [2, layers, blocks, block_size, kv_heads, head_dim]
    kv_cache = torch.randn(2, 2, 4, 4, 2, 8)
    model = str(exports[0])
    plain = DiskConnector(kv_cache, tmp_path, 1 << 20, model=model)
    quantized = DiskConnector(kv_cache.clone(), tmp_path, 1 << 20, model=model, quantization="q8_0")
    one = np.array([0])
    plain._save(one.astype(np.uint64), one, one, np.array([42], dtype=np.uint64))
    assert torch.equal(plain._read(42), kv_cache[:, :, 0])
    assert quantized._read(42) is None


def test_quantized_files_of_another_row_format_are_not_loaded(tmp_path, exports, monkeypatch):
    # int8 rows of head size 8 (+ the scale byte), written by an engine whose rows were coded
    # otherwise (an earlier layout of the same dtype and shape)
    kv_cache = torch.randint(-127, 128, (2, 2, 4, 4, 2, 9), dtype=torch.int8)
    model = str(exports[0])
    monkeypatch.setattr(disk, "kv_row_format", lambda dtype: "int8:codes,float32-scale")
    earlier = DiskConnector(kv_cache, tmp_path, 1 << 20, model=model)
    monkeypatch.undo()
    current = DiskConnector(kv_cache.clone(), tmp_path, 1 << 20, model=model)
    one = np.array([0])
    earlier._save(one.astype(np.uint64), one, one, np.array([42], dtype=np.uint64))
    assert torch.equal(earlier._read(42), kv_cache[:, :, 0])
    assert current._read(42) is None


# ---- the payload's checksum -------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped_bit", "random_payload"])
def test_a_corrupted_payload_is_recomputed_counted_and_its_file_deleted(
    tmp_path, reference, caplog, damage
):
    generate(make_disk_llm(tmp_path), prompt())
    victim = sixth_block_file(tmp_path)
    llm = make_disk_llm(tmp_path)
    connector = llm.llm_engine.kv_transfer
    raw = bytearray(victim.read_bytes())
    start = len(raw) - connector.bytes_per_block  # the payload, under a valid header
    if damage == "flipped_bit":
        raw[start + 4 * 100 + 3] ^= 0x40  # a float32's highest exponent bit
    else:
        raw[start:] = np.random.default_rng(0).bytes(connector.bytes_per_block)
    victim.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        out = generate(llm, prompt() + [9])
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert f"ignoring {victim}: its payload fails its checksum" in caplog.text
    assert connector.stats()["kv_offload_disk_corrupt_blocks"] == 1
    # the five blocks before it loaded; it and those after it were computed again
    assert out.num_cached_tokens == 5 * 4
    # the corrupted file is gone (written again since by the recomputing request's save)
    assert not victim.exists() or victim.read_bytes() != raw
    drained(llm)


# ---- the file's size --------------------------------------------------------------------


def test_an_oversized_block_file_is_rejected_from_its_size_without_being_read(tmp_path, caplog):
    generate(make_disk_llm(tmp_path), prompt())
    victim = sixth_block_file(tmp_path)
    os.truncate(victim, 512 << 20)  # sparse: valid header and payload, then 512 MiB of holes
    connector = make_disk_llm(tmp_path).llm_engine.kv_transfer
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            block = connector._read(hash_block_chain(prompt(), 4)[5])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert block is None
    assert f"ignoring {victim}: {512 << 20} bytes" in caplog.text
    assert peak < 4 << 20


# ---- the folder -------------------------------------------------------------------------


def test_a_deleted_tier_folder_is_made_again_and_no_request_fails(tmp_path):
    tier = tmp_path / "tier"
    llm = make_disk_llm(tier)
    generate(llm, prompt())
    shutil.rmtree(tier)
    want = generate(make_plain_llm(), prompt(1) + [9])
    out = generate(llm, prompt(1) + [9])
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    # the next save made the folder again and saved the new prompt there
    assert len(block_files(tier)) == 13
    drained(llm)


def test_a_read_only_tier_serves_its_loads(tmp_path, reference, monkeypatch):
    generate(make_disk_llm(tmp_path), prompt())
    files = {p: p.stat().st_mtime_ns for p in block_files(tmp_path)}
    read_only(monkeypatch)
    llm = make_disk_llm(tmp_path)
    out = generate(llm, prompt() + [9])
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert out.metrics.num_offloaded_cached_tokens == 48
    monkeypatch.undo()
    assert {p: p.stat().st_mtime_ns for p in block_files(tmp_path)} == files


def test_saves_to_a_read_only_tier_are_counted_warned_once_and_release_their_blocks(
    tmp_path, monkeypatch, caplog
):
    read_only(monkeypatch)
    llm = make_disk_llm(tmp_path)
    want = [generate(make_plain_llm(), prompt(seed)).outputs[0].token_ids for seed in (1, 2)]
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        got = [generate(llm, prompt(seed)).outputs[0].token_ids for seed in (1, 2)]
    assert got == want
    assert llm.llm_engine.get_stats()["kv_offload_disk_io_errors"] == 2 * 13
    assert caplog.text.count("the tier degrades") == 1
    assert not list(tmp_path.iterdir())
    drained(llm)


def test_the_tiers_errors_are_on_the_metrics(tmp_path, monkeypatch):
    read_only(monkeypatch)
    llm = make_disk_llm(tmp_path)
    generate(llm, prompt(1))
    families = {f.name: f for f in _offload_metrics(llm.llm_engine.get_stats(), block_size=4)}
    samples = {
        s.labels["reason"]: s.value for s in families["pagedllm:kv_offload_disk_errors"].samples
    }
    assert samples == {"io": 13.0, "corrupt": 0.0}


def test_evicting_skips_the_files_another_engine_deleted_meanwhile(tmp_path, monkeypatch):
    one = make_disk_llm(tmp_path).llm_engine.kv_transfer.file_bytes(0)
    llm = make_disk_llm(tmp_path, kv_offloading_size=8 * one / 2**30)
    listed = os.scandir

    @contextlib.contextmanager
    def listed_then_raced(path):
        """The listing, then another engine evicting every other listed block file."""
        with listed(path) as it:
            entries = list(it)
        for entry in entries[::2]:
            if entry.name.endswith(disk.SUFFIX):
                os.unlink(entry.path)
        yield iter(entries)

    monkeypatch.setattr(os, "scandir", listed_then_raced)
    want = [generate(make_plain_llm(), prompt(seed)).outputs[0].token_ids for seed in (1, 2)]
    got = [generate(llm, prompt(seed)).outputs[0].token_ids for seed in (1, 2)]
    monkeypatch.undo()
    assert got == want
    assert sum(p.stat().st_size for p in block_files(tmp_path)) <= 8 * one + 64
    assert llm.llm_engine.get_stats()["kv_offload_disk_io_errors"] == 0
    drained(llm)


def test_a_save_that_raises_releases_its_blocks(tmp_path, caplog):
    llm = make_disk_llm(tmp_path)
    connector = llm.llm_engine.kv_transfer

    def broken(*args):
        raise RuntimeError("gather failed")

    connector._save = broken
    want = generate(make_plain_llm(), prompt(1)).outputs[0].token_ids
    with caplog.at_level(logging.ERROR, logger="pagedllm"):
        out = generate(llm, prompt(1))
    assert out.outputs[0].token_ids == want
    assert "a KV save to the offload tier failed" in caplog.text
    assert not block_files(tmp_path)
    drained(llm)
