"""KVCacheManager through the Python bindings: one behaviour per test."""

from __future__ import annotations

import pytest

import pagedllm
from pagedllm import AllocStatus, KVCacheManager, PagedLLMError, _core


def make(num_gpu_blocks=16, block_size=4, num_cpu_blocks=8, **kw) -> KVCacheManager:
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(
        num_gpu_blocks=num_gpu_blocks, block_size=block_size, num_cpu_blocks=num_cpu_blocks, **kw
    )


def test_public_names_are_reexported_by_the_package():
    assert pagedllm.KVCacheManager is _core.KVCacheManager
    assert pagedllm.AllocStatus is _core.AllocStatus
    assert pagedllm.PagedLLMError is _core.PagedLLMError
    assert issubclass(PagedLLMError, Exception)


def test_default_manager_has_16_token_blocks_no_host_blocks_1_percent_watermark_and_caching():
    m = KVCacheManager(num_gpu_blocks=200)
    assert m.block_size == 16
    assert m.num_cpu_blocks == 0
    assert m.watermark_blocks == 2
    assert m.enable_prefix_caching


def test_allocate_builds_table_and_slot_layout():
    m = make()
    assert m.allocate(1, list(range(10))) == 0
    table = m.block_table(1)
    assert table == [0, 1, 2]
    assert m.num_free_gpu_blocks == 13
    # slot of token t = table[t // bs] * bs + t % bs
    slots = [table[t // 4] * 4 + t % 4 for t in range(10)]
    assert slots == list(range(10))
    m.check_invariants()


def test_allocate_num_slots_covers_only_the_requested_slots():
    m = make()
    assert m.allocate(1, list(range(20)), num_slots=5) == 0
    assert len(m.block_table(1)) == 2


def test_allocate_returns_none_without_room_and_changes_nothing():
    m = make(num_gpu_blocks=2)
    assert m.allocate(1, list(range(12))) is None
    assert 1 not in m
    assert m.num_free_gpu_blocks == 2
    m.check_invariants()


def test_allocate_keeps_the_watermark_free_unless_told_otherwise():
    m = make(num_gpu_blocks=10, block_size=1, watermark=0.2)
    assert m.allocate(1, list(range(9))) is None
    assert m.allocate(1, list(range(9)), apply_watermark=False) == 0


def test_can_allocate_ok_later_never():
    m = make(num_gpu_blocks=10, watermark=0.1)
    assert m.can_allocate(36) == AllocStatus.OK
    assert m.can_allocate(37) == AllocStatus.NEVER
    m.allocate(1, list(range(8)))
    assert m.can_allocate(28) == AllocStatus.OK
    assert m.can_allocate(29) == AllocStatus.LATER


def test_can_append_slots_is_conservative_with_lookahead():
    m = make(num_gpu_blocks=4)
    assert m.can_append_slots(4)
    assert not m.can_append_slots(5)
    assert m.can_append_slots(2, num_lookahead_slots=4)
    assert not m.can_append_slots(2, num_lookahead_slots=5)


def test_append_slots_grows_table_only_when_a_block_fills():
    m = make()
    m.allocate(1, list(range(4)))
    assert m.append_slots(1, 4, 5) == []
    assert len(m.block_table(1)) == 2
    assert m.append_slots(1, 5, 8) == []
    assert len(m.block_table(1)) == 2
    m.check_invariants()


def test_fork_shares_blocks_and_bumps_ref_counts():
    m = make()
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    assert m.block_table(2) == m.block_table(1)
    assert [m.ref_count(b) for b in m.block_table(1)] == [2, 2]
    m.check_invariants()


def test_append_to_shared_last_block_copies_on_write():
    m = make()
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    full, last = m.block_table(1)
    copies = m.append_slots(2, 6, 7)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == last
    assert m.block_table(2) == [full, dst]
    assert m.ref_count(full) == 2, "full shared blocks stay shared"
    assert m.ref_count(last) == 1
    assert m.append_slots(1, 6, 7) == [], "the parent now owns its last block alone"
    m.check_invariants()


def test_append_slots_returns_none_when_out_of_blocks():
    m = make(num_gpu_blocks=2)
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    assert m.append_slots(2, 6, 9) is None
    assert m.block_table(2) == m.block_table(1)
    m.check_invariants()


def test_free_returns_every_block():
    m = make()
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    m.free(1)
    assert m.num_free_gpu_blocks == 14
    m.free(2)
    assert m.num_free_gpu_blocks == 16
    assert m.seq_ids() == []
    m.check_invariants()


def test_prefix_hit_reuses_full_blocks_but_computes_last_token():
    m = make()
    prompt = list(range(12))
    m.allocate(1, prompt)
    assert m.cache_full_blocks(1, prompt, 12) == 3
    # 12 tokens = 3 full blocks, but the last one holds the last token: 2 reused.
    assert m.allocate(2, prompt) == 8
    assert m.block_table(2)[:2] == m.block_table(1)[:2]
    assert m.block_table(2)[2] != m.block_table(1)[2]
    m.check_invariants()


def test_lookup_is_read_only_unless_counted():
    m = make()
    prompt = list(range(9))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt, 9)
    before = m.stats()
    hit = m.lookup(prompt)
    assert hit.num_cached_tokens == 8
    assert hit.blocks == m.block_table(1)[:2]
    assert hit.hashes == _core.hash_block_chain(prompt, 4)
    assert m.stats() == before
    m.lookup(prompt, count=True)
    assert m.stats()["prefix_cache_queries"] == before["prefix_cache_queries"] + 1


def test_allocate_hit_uses_a_lookup_result():
    m = make()
    prompt = list(range(9))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt, 9)
    hit = m.lookup(prompt)
    assert m.can_allocate_with_prefix(hit, 9) == AllocStatus.OK
    assert m.allocate_hit(2, hit, 9)
    assert m.block_table(2)[:2] == hit.blocks


def test_prefix_cache_counts_queries_hits_and_misses():
    m = make()
    prompt = list(range(13))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt, 13)
    m.allocate(2, prompt)
    s = m.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"], s["prefix_cache_misses"]) == (
        2,
        3,
        3,
    )
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.5)


def test_extra_key_separates_prefixes():
    m = make()
    prompt = list(range(9))
    m.allocate(1, prompt, extra_key=5)
    m.cache_full_blocks(1, prompt, 9, extra_key=5)
    assert m.allocate(2, prompt) == 0
    assert m.allocate(3, prompt, extra_key=5) == 8


def test_freed_cached_blocks_wait_deepest_first_and_revive_on_hit():
    m = make(num_gpu_blocks=8)
    prompt = list(range(9))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt, 9)
    t1 = m.block_table(1)
    m.free(1)
    assert m.evictable_blocks() == [t1[1], t1[0]]
    assert m.num_cached_gpu_blocks == 2
    assert m.num_free_gpu_blocks == 8, "cached blocks count as free"
    assert m.allocate(2, prompt) == 8
    assert m.block_table(2)[:2] == t1[:2]
    assert m.evictable_blocks() == []
    m.check_invariants()


def test_never_used_blocks_are_taken_before_evicting_least_recently_freed():
    m = make(num_gpu_blocks=6, block_size=2)
    a, b = list(range(5)), list(range(100, 105))
    for seq, p in ((1, a), (2, b)):
        m.allocate(seq, p)
        m.cache_full_blocks(seq, p, 5)
    ta, tb = m.block_table(1), m.block_table(2)
    m.free(1)
    m.free(2)
    assert m.evictable_blocks() == [ta[1], ta[0], tb[1], tb[0]]
    m.allocate(3, list(range(200, 206)))
    # The two uncached partial blocks first, then the oldest-freed deepest cached block.
    assert sorted(m.block_table(3)) == sorted([ta[2], tb[2], ta[1]])
    assert m.block_hash(ta[1]) is None
    assert m.stats()["prefix_cache_evictions"] == 1
    m.check_invariants()


def test_cache_full_blocks_registers_decoded_blocks_incrementally():
    m = make(block_size=2)
    tokens = [1, 2, 3]
    m.allocate(1, tokens)
    assert m.cache_full_blocks(1, tokens, 3) == 1
    tokens.append(4)
    m.append_slots(1, 3, 4)
    assert m.cache_full_blocks(1, tokens, 4) == 1
    assert m.allocate(2, tokens + [5]) == 4


def test_cache_full_blocks_leaves_an_existing_mapping_alone():
    m = make(block_size=2)
    p = [1, 2, 3, 4]
    m.allocate(1, p)
    m.allocate(2, p)
    assert m.cache_full_blocks(1, p, 4) == 2
    assert m.cache_full_blocks(2, p, 4) == 0
    assert m.block_hash(m.block_table(2)[0]) is None
    m.check_invariants()


def test_prefix_caching_disabled_never_hits():
    m = make(enable_prefix_caching=False)
    p = list(range(9))
    m.allocate(1, p)
    assert m.cache_full_blocks(1, p, 9) == 0
    assert m.allocate(2, p) == 0
    m.free(1)
    assert m.num_cached_gpu_blocks == 0


def test_reset_prefix_cache_forgets_cached_blocks():
    m = make()
    p = list(range(9))
    m.allocate(1, p)
    m.cache_full_blocks(1, p, 9)
    m.free(1)
    m.reset_prefix_cache()
    assert m.num_cached_gpu_blocks == 0
    assert m.stats()["num_registered_blocks"] == 0
    assert m.allocate(2, p) == 0
    m.check_invariants()


def test_swap_out_moves_shared_blocks_once_and_swap_in_restores_sharing():
    m = make(num_gpu_blocks=8, num_cpu_blocks=8)
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    m.append_slots(2, 6, 7)
    assert m.can_swap_out([1, 2])
    out = m.swap_out([1, 2])
    assert len(out) == 3
    assert len({d for d, _ in out}) == 3 and len({h for _, h in out}) == 3
    assert m.is_swapped(1) and m.is_swapped(2)
    assert m.num_free_gpu_blocks == 8
    assert m.num_free_cpu_blocks == 5
    h1, h2 = m.block_table(1), m.block_table(2)
    assert h1[0] == h2[0] and m.ref_count(h1[0], device=False) == 2
    m.check_invariants()
    assert m.can_swap_in([1, 2]) == AllocStatus.OK
    back = m.swap_in([1, 2])
    assert len(back) == 3
    d1, d2 = m.block_table(1), m.block_table(2)
    assert d1[0] == d2[0] and m.ref_count(d1[0]) == 2
    assert dict(back)[h1[0]] == d1[0]
    assert m.num_free_cpu_blocks == 8
    m.check_invariants()


def test_can_swap_out_false_when_host_is_short():
    m = make(num_cpu_blocks=1)
    m.allocate(1, list(range(8)))
    assert not m.can_swap_out([1])


def test_can_swap_in_never_when_group_exceeds_device_pool():
    m = make(num_gpu_blocks=2, num_cpu_blocks=4)
    m.allocate(1, list(range(8)))
    m.swap_out([1])
    assert m.can_swap_in([1]) == AllocStatus.OK
    assert m.can_swap_in([1], num_lookahead_slots=1) == AllocStatus.NEVER
    m.allocate(2, [7])
    assert m.can_swap_in([1]) == AllocStatus.LATER


def test_free_of_swapped_sequence_releases_host_blocks():
    m = make()
    m.allocate(1, list(range(8)))
    m.swap_out([1])
    m.free(1)
    assert m.num_free_cpu_blocks == 8
    m.check_invariants()


def test_stats_and_usage_count_device_and_host_blocks():
    m = make(num_gpu_blocks=8, num_cpu_blocks=4)
    m.allocate(1, list(range(8)))
    m.allocate(2, list(range(50, 58)))
    m.swap_out([2])
    s = m.stats()
    assert s["num_free_gpu_blocks"] == 6 and s["num_free_cpu_blocks"] == 2
    assert s["num_sequences"] == 2 and s["num_swapped_sequences"] == 1
    assert m.usage() == pytest.approx(0.25) == s["gpu_usage"]
    assert m.cpu_usage() == pytest.approx(0.5) == s["cpu_usage"]


def test_check_invariants_passes_on_a_fresh_manager():
    make().check_invariants()


def test_hash_block_is_chained_and_deterministic():
    tokens = list(range(16))
    h0 = _core.hash_block(_core.ROOT_HASH, tokens)
    assert h0 == _core.hash_block(_core.ROOT_HASH, tokens)
    assert h0 != _core.hash_block(_core.ROOT_HASH, tokens, extra_key=1)
    assert _core.hash_block_chain(tokens + tokens, 16) == [h0, _core.hash_block(h0, tokens)]
    assert _core._time_hash_block(16, 1000) > 0


def test_alloc_status_is_enum_like():
    assert AllocStatus.OK != AllocStatus.LATER
    assert len({AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER}) == 3
    assert repr(AllocStatus.NEVER) == "AllocStatus.NEVER"
