"""The disk tier and a quantized cache's key calibration (`worker/kv_calibration.py`): blocks
stored under another calibration, or none, are never loaded (their tokens computed again)."""

import numpy as np
import pytest
import torch
from kv_transfer_util import generate, make_disk_llm, prompt

from pagedllm.config import TINY_RANDOM_MODEL
from pagedllm.kv_transfer import DiskConnector
from pagedllm.worker import kv_calibration


def _connector(tmp_path, kv_cache, key_calibration):
    return DiskConnector(
        kv_cache, tmp_path, 1 << 20, model=TINY_RANDOM_MODEL, key_calibration=key_calibration
    )


@pytest.mark.parametrize("reader", ["b" * 32, None], ids=["other_calibration", "none"])
def test_a_block_of_another_key_calibration_is_not_loaded(tmp_path, reader):
    # int8 rows of head size 8 (+ the scale byte)
    kv_cache = torch.randint(-127, 128, (2, 2, 4, 4, 2, 9), dtype=torch.int8)
    writer = _connector(tmp_path, kv_cache, "a" * 32)
    one = np.array([0])
    writer._save(one.astype(np.uint64), one, one, np.array([42], dtype=np.uint64))
    assert torch.equal(
        _connector(tmp_path, kv_cache.clone(), "a" * 32)._read(42), kv_cache[:, :, 0]
    )
    assert _connector(tmp_path, kv_cache.clone(), reader)._read(42) is None


def test_an_engine_loads_the_tier_of_its_own_calibration_only(tmp_path, monkeypatch):
    tier, tokens = tmp_path / "tier", prompt()
    monkeypatch.setenv(kv_calibration.ENV, "64")
    first = make_disk_llm(tier, kv_cache_dtype="int8")
    digest = first.llm_engine.cache_engine.key_calibration.digest
    assert first.llm_engine.kv_transfer.identity["key_calibration"] == digest
    generate(first, tokens)
    first.llm_engine.shutdown()
    # (one tier file per block: the other calibration's engine would replace the files)
    same = generate(make_disk_llm(tier, kv_cache_dtype="int8"), tokens + [9])
    assert same.metrics.num_offloaded_cached_tokens > 0
    monkeypatch.setenv(kv_calibration.ENV, "32")
    other = generate(make_disk_llm(tier, kv_cache_dtype="int8"), tokens + [9])
    assert other.metrics.num_offloaded_cached_tokens == 0
