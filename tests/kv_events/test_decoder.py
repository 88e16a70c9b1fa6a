"""The Rust decoder: a KV-event batch back into the arrays it was encoded from (kinds, hashes,
parents, tokens with offsets, media, adapter ids), the router's records with each record's
medium, and a payload that is not a batch refused naming what is wrong."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pagedllm._core import (
    KV_EVENT_ALL_CLEARED,
    KV_EVENT_MEDIA,
    KV_EVENT_REMOVED,
    KV_EVENT_STORED,
    ROOT_HASH,
    decode_kv_event_batch,
    encode_kv_event_batch,
    kv_event_index_records,
    lora_hash_key,
)

KINDS = [KV_EVENT_STORED, KV_EVENT_STORED, KV_EVENT_REMOVED, KV_EVENT_ALL_CLEARED]
HASHES = [7, 300, 2**63 + 5, 7]
TOKENS = [1, 2, 200, 70000, 5, 6, 0, 0]


def encoded() -> bytes:
    return encode_kv_event_batch(
        1.25,
        np.array(KINDS, np.uint8),
        np.array([0, 2, 3, 4, 4], np.uint32),
        np.array([ROOT_HASH, 300, ROOT_HASH, ROOT_HASH], np.uint64),
        np.array([0, lora_hash_key(3), 0, 0], np.uint64),
        np.array(HASHES, np.uint64),
        np.array(TOKENS, np.uint32),
        block_size=2,
        lora_keys=[lora_hash_key(3)],
        lora_ids=[3],
        medium="GPU",
        data_parallel_rank=2,
    )


def test_a_batch_decodes_into_the_arrays_it_was_encoded_from():
    d = decode_kv_event_batch(encoded())
    assert (d["ts"], d["data_parallel_rank"]) == (1.25, 2)
    assert d["kinds"].tolist() == KINDS
    assert d["starts"].tolist() == [0, 2, 3, 4, 4]
    assert d["hashes"].tolist() == HASHES and d["hash_is_int"].all()
    assert d["parents"].tolist() == [ROOT_HASH, 300, ROOT_HASH, ROOT_HASH]
    assert d["token_starts"].tolist() == [0, 4, 6, 6, 6]
    assert d["tokens"].tolist() == TOKENS[:6]
    assert d["lora_ids"].tolist() == [0, 3, 0, 0]
    assert d["block_sizes"].tolist() == [2, 2, 0, 0]
    assert [KV_EVENT_MEDIA[m] for m in d["media"]] == ["GPU"] * 4


def test_the_routers_records_carry_each_events_medium():
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2], "medium": "CPU", "token_ids": []},
        {"type": "BlockStored", "block_hashes": [3], "medium": "STORAGE", "token_ids": []},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [4]},
    ]
    kinds, starts, hashes, media = kv_event_index_records(msgpack.packb([0.0, events, 0]))
    assert kinds.tolist() == [KV_EVENT_STORED] * 2 + [KV_EVENT_REMOVED] * 2
    assert starts.tolist() == [0, 2, 3, 4, 5] and hashes.tolist() == [1, 2, 3, 1, 4]
    assert [KV_EVENT_MEDIA[m] for m in media] == ["CPU", "STORAGE", "CPU", "GPU"]


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (b"\xc1", "not msgpack"),
        (encoded()[:-3], "not msgpack"),
        (encoded() + b"\x00", "after the batch"),
        (msgpack.packb([1.0]), "not [ts, events, rank]"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]]), "block_hashes"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1 << 32]]]]), "token_ids"),
    ],
    ids=["reserved-byte", "truncated", "trailing-bytes", "no-events", "negative-hash", "token"],
)
def test_a_payload_that_is_not_a_batch_is_a_value_error_naming_what_is_wrong(payload, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        decode_kv_event_batch(payload)
