"""Another engine's KV events (vLLM's: its own block hashes, the token ids beside them)
re-hashed into the router's hashes: stored chains continue from their parent's re-hash, removals
and clears follow the table, blocks that cannot be re-hashed are left out, and a batch the index
refused leaves the table as it was."""

from __future__ import annotations

import threading

import msgpack
import numpy as np

from pagedllm._core import Router, hash_block_chain
from pagedllm.kv_events.foreign import ForeignHashes, foreign_key
from pagedllm.kv_events.subscriber import KVEventSubscriber, decode_batch

BLOCK = 4
TOKENS = list(range(100, 116))  # four blocks


def stored(hashes, parent, tokens, block_size=BLOCK, lora_id=None, extra_keys=None) -> list:
    """vLLM's BlockStored in its array form (tag first, trailing defaults left out)."""
    event = ["BlockStored", hashes, parent, tokens, block_size, lora_id, None]
    if extra_keys is not None:
        event += [None, extra_keys]
    return event


def batch(*events) -> bytes:
    return msgpack.packb([1.0, list(events)])


def test_a_stored_chain_gets_the_routers_own_hashes():
    table = ForeignHashes(BLOCK)
    _, _, hashes = decode_batch(batch(stored([901, 902], None, TOKENS[:8])), table)
    table.commit()
    assert hashes.tolist() == hash_block_chain(TOKENS[:8], BLOCK)


def test_vllms_map_form_is_read_as_the_array_form():
    # what vLLM 0.32 publishes by default: each event a map, its tag under "type"
    event = {
        "type": "BlockStored",
        "block_hashes": [901, 902],
        "parent_block_hash": None,
        "token_ids": TOKENS[:8],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    table = ForeignHashes(BLOCK)
    payload = msgpack.packb([1.0, [event, {"type": "BlockRemoved", "block_hashes": [902]}], 0])
    kinds, starts, hashes = decode_batch(payload, table)
    own = hash_block_chain(TOKENS[:8], BLOCK)
    assert kinds.tolist() == [0, 1] and starts.tolist() == [0, 2, 3]
    assert hashes.tolist() == [*own, own[1]]


def test_a_payload_that_is_not_a_batch_leaves_its_number_to_the_real_batch():
    index = Router(1, BLOCK, "cache_aware")
    sub = KVEventSubscriber(index, threading.Lock(), 0, "ipc://unused", None)
    sub._on_message([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
    assert (index.next_seq(0), sub.malformed) == (0, 1)
    sub._on_message([b"", (0).to_bytes(8, "big"), batch(stored([901], None, TOKENS[:4]))])
    assert index.replica_hashes(0).tolist() == [901]


def test_a_replayed_payload_that_is_not_a_batch_is_kept_in_sequence_as_empty():
    # the replica's own answer: asking again would get the same
    index = Router(1, BLOCK, "cache_aware")
    sub = KVEventSubscriber(index, threading.Lock(), 0, "ipc://unused", None)
    sub._apply(0, b"\xc1 not msgpack", replayed=True)
    assert (index.next_seq(0), sub.malformed) == (1, 1)


def test_a_chain_continued_from_a_stored_parent_continues_the_own_chain():
    table = ForeignHashes(BLOCK)
    decode_batch(batch(stored([901, 902], None, TOKENS[:8])), table)
    table.commit()
    _, _, hashes = decode_batch(batch(stored([903, 904], 902, TOKENS[8:])), table)
    assert hashes.tolist() == hash_block_chain(TOKENS, BLOCK)[2:]


def test_a_parent_stored_earlier_in_the_same_batch_is_found():
    table = ForeignHashes(BLOCK)
    payload = batch(stored([901], None, TOKENS[:4]), stored([902], 901, TOKENS[4:8]))
    _, _, hashes = decode_batch(payload, table)
    assert hashes.tolist() == hash_block_chain(TOKENS[:8], BLOCK)


def test_removed_blocks_are_named_by_their_own_hashes_and_forgotten():
    table = ForeignHashes(BLOCK)
    decode_batch(batch(stored([901, 902], None, TOKENS[:8])), table)
    table.commit()
    own = hash_block_chain(TOKENS[:8], BLOCK)
    kinds, _, hashes = decode_batch(batch(["BlockRemoved", [902, 777]]), table)
    table.commit()
    assert kinds.tolist() == [1] and hashes.tolist() == [own[1]]
    assert table.own == {901: own[0]}


def test_all_blocks_cleared_empties_the_table():
    table = ForeignHashes(BLOCK)
    decode_batch(batch(stored([901], None, TOKENS[:4]), ["AllBlocksCleared"]), table)
    table.commit()
    assert table.own == {}


def test_blocks_that_cannot_be_rehashed_are_left_out():
    table = ForeignHashes(BLOCK)
    unseen_parent = stored([903], 555, TOKENS[8:12])
    lora = stored([904], None, TOKENS[:4], lora_id=1)
    other_size = stored([905], None, TOKENS[:8], block_size=8)
    salted = stored([906], None, TOKENS[:4], extra_keys=[["salt"]])
    short = stored([907, 908], None, TOKENS[:5])
    kinds, starts, hashes = decode_batch(
        batch(unseen_parent, lora, other_size, salted, short), table
    )
    assert kinds.tolist() == [0] * 5 and starts.tolist() == [0] * 6 and hashes.size == 0


def test_a_batch_the_index_refused_leaves_the_table_as_it_was():
    table = ForeignHashes(BLOCK)
    decode_batch(batch(stored([901], None, TOKENS[:4])), table)
    table.commit()
    before = dict(table.own)
    decode_batch(batch(["BlockRemoved", [901]], stored([902], None, TOKENS[4:8])), table)
    table.rollback()
    assert table.own == before
    # replayed, the removal is found again
    _, _, hashes = decode_batch(batch(["BlockRemoved", [901]]), table)
    assert hashes.tolist() == [before[901]]


def test_bytes_hashes_are_keyed_by_their_low_64_bits():
    digest = bytes(range(32))
    assert foreign_key(digest) == int.from_bytes(digest[-8:], "big")
    table = ForeignHashes(BLOCK)
    decode_batch(batch(stored([digest], None, TOKENS[:4])), table)
    table.commit()
    _, _, hashes = decode_batch(batch(["BlockRemoved", [foreign_key(digest)]]), table)
    assert hashes.tolist() == hash_block_chain(TOKENS[:4], BLOCK)


def test_a_subscriber_without_replay_starts_the_replica_over_at_a_gap():
    index, lock = Router(1, BLOCK, "cache_aware"), threading.Lock()
    sub = KVEventSubscriber(index, lock, 0, "ipc://unused", None, foreign=ForeignHashes(BLOCK))
    sub._apply(0, batch(stored([901], None, TOKENS[:4])))
    sub._apply(5, batch(stored([902], None, TOKENS[4:8])))  # 1..4 lost, nothing to ask
    assert index.next_seq(0) == 6
    assert sorted(index.replica_hashes(0).tolist()) == sorted(
        np.array(hash_block_chain(TOKENS[4:8], BLOCK), np.uint64).tolist()
    )
