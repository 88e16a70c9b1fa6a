"""The model fingerprint in the disk tier's block files: new weights at the same path (even
under identical safetensors headers and sizes), a changed config or tokenizer, or another
single weights file change it; the same files elsewhere do not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm.cli.export_tiny import export_tiny
from pagedllm.kv_transfer.fingerprint import HEAD_BYTES, SAMPLE_BYTES, model_fingerprint
from pagedllm.models import tiny_random


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny model exported with two seeds: same shapes, other weights."""
    root = tmp_path_factory.mktemp("fingerprint")
    return [export_tiny(root / f"seed{seed}", seed=seed)["model"] for seed in (0, 1)]


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "model")


def test_new_weights_under_the_same_headers_and_sizes_change_the_fingerprint(exports, tmp_path):
    model = copy_of(exports[0], tmp_path)
    before = model_fingerprint(str(model))
    old, new = (folder / "model.safetensors" for folder in exports)
    assert old.stat().st_size == new.stat().st_size
    shutil.copyfile(new, model / "model.safetensors")
    assert model_fingerprint(str(model)) != before


def test_the_same_files_at_another_path_have_the_same_fingerprint(exports, tmp_path):
    assert model_fingerprint(str(copy_of(exports[0], tmp_path))) == model_fingerprint(
        str(exports[0])
    )


def test_a_changed_config_changes_the_fingerprint(exports, tmp_path):
    model = copy_of(exports[0], tmp_path)
    before = model_fingerprint(str(model))
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (model / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(str(model)) != before


def test_a_changed_tokenizer_changes_the_fingerprint(exports, tmp_path):
    model = copy_of(exports[0], tmp_path)
    tokenizer = shutil.copytree(exports[0], tmp_path / "tokenizer")
    before = model_fingerprint(str(model), str(tokenizer))
    assert before != model_fingerprint(str(model))  # a tokenizer elsewhere counts
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["model_max_length"] = 7
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    assert model_fingerprint(str(model), str(tokenizer)) != before


@pytest.mark.parametrize("where", ["metadata", "tensor data"])
def test_a_single_weights_file_is_fingerprinted_by_its_metadata_and_data(tmp_path, where):
    gguf = tmp_path / "model.gguf"
    size = HEAD_BYTES + 64 * SAMPLE_BYTES * 4
    with open(gguf, "wb") as f:
        f.write(b"GGUF" + bytes(range(256)) * 64)
        f.truncate(size)
    before = model_fingerprint(str(gguf))
    # a byte of the metadata region, or the file's last byte (inside the last sample)
    offset = 100 if where == "metadata" else size - 1
    with open(gguf, "r+b") as f:
        f.seek(offset)
        f.write(b"\x01")
    assert model_fingerprint(str(gguf)) != before


def test_the_built_in_models_fingerprint_follows_the_code_that_draws_its_weights(
    tmp_path, monkeypatch
):
    before = model_fingerprint("pagedllm/tiny-random")
    source = Path(tiny_random.__file__).read_text()
    assert "DEFAULT_SEED = 0" in source
    reseeded = tmp_path / "tiny_random.py"
    reseeded.write_text(source.replace("DEFAULT_SEED = 0", "DEFAULT_SEED = 1"))
    monkeypatch.setattr(tiny_random, "__file__", str(reseeded))
    assert model_fingerprint("pagedllm/tiny-random") != before


def test_a_packaged_models_short_name_is_fingerprinted_by_its_file(tmp_path, monkeypatch):
    from pagedllm.checkpoint import packaged as packages

    packaged = tmp_path / "packaged.gguf"
    packaged.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setattr(
        packages, "resolve_model", lambda name: str(packaged) if name == "short" else name
    )
    assert model_fingerprint("short") == model_fingerprint(str(packaged))
