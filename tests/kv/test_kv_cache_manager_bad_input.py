"""Bad input to KVCacheManager: a clear exception, the manager unchanged and still consistent."""

from __future__ import annotations

import pytest

from pagedllm import KVCacheManager, PagedLLMError


def snapshot(m: KVCacheManager) -> dict:
    """Everything observable about a manager's state."""
    return {
        "stats": m.stats(),
        "tables": {s: (m.block_table(s), m.is_swapped(s)) for s in m.seq_ids()},
        "gpu_refs": [m.ref_count(b) for b in range(m.num_gpu_blocks)],
        "cpu_refs": [m.ref_count(b, device=False) for b in range(m.num_cpu_blocks)],
        "hashes": [m.block_hash(b) for b in range(m.num_gpu_blocks)],
        "evictable": m.evictable_blocks(),
    }


@pytest.fixture
def busy() -> KVCacheManager:
    """A manager with shared, cached, swapped and running sequences."""
    m = KVCacheManager(num_gpu_blocks=8, block_size=4, num_cpu_blocks=3, watermark=0.0)
    prompt = list(range(10))
    m.allocate(1, prompt)
    m.cache_full_blocks(1, prompt, 10)
    m.fork(1, 2)
    m.allocate(3, prompt)  # prefix hit on seq 1's blocks
    m.allocate(4, [50, 51, 52, 53, 54])
    m.swap_out([4])
    m.allocate(5, [60, 61, 62, 63, 64])
    m.cache_full_blocks(5, [60, 61, 62, 63, 64], 5)
    m.free(5)  # leaves a cached, evictable block
    m.check_invariants()
    return m


def expect_unchanged(m: KVCacheManager, before: dict) -> None:
    assert snapshot(m) == before
    m.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.free(99),
        lambda m: m.block_table(99),
        lambda m: m.is_swapped(99),
        lambda m: m.append_slots(99, 0, 1),
        lambda m: m.cache_full_blocks(99, [1, 2, 3, 4], 4),
        lambda m: m.fork(99, 100),
        lambda m: m.swap_out([1, 99]),
        lambda m: m.swap_in([4, 99]),
        lambda m: m.can_swap_out([99]),
        lambda m: m.can_swap_in([99]),
    ],
    ids=[
        "free",
        "block_table",
        "is_swapped",
        "append_slots",
        "cache_full_blocks",
        "fork",
        "swap_out",
        "swap_in",
        "can_swap_out",
        "can_swap_in",
    ],
)
def test_unknown_sequence_id_raises_value_error_naming_it(busy, call):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="unknown sequence id 99"):
        call(busy)
    expect_unchanged(busy, before)


def test_double_free_raises_and_keeps_the_shared_blocks(busy):
    busy.free(2)
    before = snapshot(busy)
    with pytest.raises(ValueError, match="unknown sequence id 2"):
        busy.free(2)
    expect_unchanged(busy, before)


def test_swap_in_without_device_room_raises_paged_llm_error(busy):
    busy.allocate(6, list(range(100, 112)), apply_watermark=False)  # fill the device pool
    before = snapshot(busy)
    with pytest.raises(PagedLLMError, match="out of device blocks"):
        busy.swap_in([4])
    expect_unchanged(busy, before)
    assert busy.is_swapped(4)


def test_swap_out_without_host_room_raises_paged_llm_error(busy):
    before = snapshot(busy)
    assert not busy.can_swap_out([1, 2, 3])
    with pytest.raises(PagedLLMError, match="out of host"):
        busy.swap_out([1, 2, 3])
    expect_unchanged(busy, before)


def test_swap_in_of_a_resident_sequence_is_an_invalid_state(busy):
    before = snapshot(busy)
    with pytest.raises(PagedLLMError, match="not swapped out"):
        busy.swap_in([1])
    expect_unchanged(busy, before)


def test_append_to_a_swapped_sequence_is_an_invalid_state(busy):
    before = snapshot(busy)
    with pytest.raises(PagedLLMError, match="swapped out"):
        busy.append_slots(4, 5, 6)
    expect_unchanged(busy, before)


def test_sequence_listed_twice_in_a_swap_group_is_rejected(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="listed twice"):
        busy.swap_out([1, 1])
    expect_unchanged(busy, before)


def test_block_size_zero_is_rejected():
    with pytest.raises(ValueError, match="block_size must be > 0"):
        KVCacheManager(num_gpu_blocks=4, block_size=0)


@pytest.mark.parametrize("field", ["num_gpu_blocks", "num_cpu_blocks", "block_size"])
def test_negative_constructor_count_raises_value_error_naming_it(field):
    kwargs = {"num_gpu_blocks": 4, "num_cpu_blocks": 4, "block_size": 4, field: -1}
    with pytest.raises(ValueError, match=f"{field} must be >= 0, got -1"):
        KVCacheManager(**kwargs)


@pytest.mark.parametrize("watermark", [-0.1, 1.0, float("nan")])
def test_watermark_outside_unit_interval_is_rejected(watermark):
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(num_gpu_blocks=4, watermark=watermark)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda m: m.can_allocate(-1), "num_tokens"),
        (lambda m: m.can_append_slots(-2), "num_running_seqs"),
        (lambda m: m.can_append_slots(1, -1), "num_lookahead_slots"),
        (lambda m: m.can_swap_in([4], -1), "num_lookahead_slots"),
        (lambda m: m.append_slots(1, -1, 11), "first_new_slot"),
        (lambda m: m.append_slots(1, 10, -3), "num_slots"),
        (lambda m: m.allocate(7, [1, 2], num_slots=-1), "num_slots"),
        (lambda m: m.cache_full_blocks(1, list(range(10)), -4), "num_computed_tokens"),
    ],
    ids=[
        "can_allocate",
        "can_append_seqs",
        "can_append_lookahead",
        "can_swap_in",
        "append_first",
        "append_num",
        "allocate",
        "cache_full_blocks",
    ],
)
def test_negative_number_raises_value_error_naming_it(busy, call, name):
    before = snapshot(busy)
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        call(busy)
    expect_unchanged(busy, before)


def test_negative_sequence_and_token_ids_are_value_errors(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="sequence id must be >= 0, got -5"):
        busy.allocate(-5, [1, 2])
    with pytest.raises(ValueError, match="token id -3 is out of range"):
        busy.allocate(7, [1, -3])
    with pytest.raises(ValueError, match="block id -1"):
        busy.ref_count(-1)
    with pytest.raises(ValueError, match="device block id 8"):
        busy.ref_count(8)
    expect_unchanged(busy, before)


def test_duplicate_sequence_on_allocate_leaves_first_untouched(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="sequence id 1 already exists"):
        busy.allocate(1, [9, 9, 9])
    expect_unchanged(busy, before)


def test_fork_onto_an_existing_sequence_is_rejected_and_changes_nothing(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="sequence id 3 already exists"):
        busy.fork(1, 3)
    with pytest.raises(ValueError, match="sequence id 1 already exists"):
        busy.fork(1, 1)
    expect_unchanged(busy, before)


def test_stale_prefix_hit_is_rejected(busy):
    prompt = [60, 61, 62, 63, 64]
    hit = busy.lookup(prompt)
    assert hit.blocks, "seq 5's cached block is a hit"
    busy.allocate(6, list(range(200, 216)), apply_watermark=False)  # evicts it
    before = snapshot(busy)
    with pytest.raises(ValueError, match="stale prefix hit"):
        busy.allocate_hit(7, hit, 5)
    expect_unchanged(busy, before)


def test_cache_full_blocks_past_the_table_is_rejected(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="exceeds"):
        busy.cache_full_blocks(1, list(range(40)), 40)
    with pytest.raises(ValueError, match="exceeds the 3 tokens"):
        busy.cache_full_blocks(1, [1, 2, 3], 4)
    expect_unchanged(busy, before)


def test_first_new_slot_past_num_slots_is_rejected(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="first_new_slot 12 is past num_slots 11"):
        busy.append_slots(1, 12, 11)
    expect_unchanged(busy, before)


def test_first_new_slot_past_the_table_is_rejected_not_a_panic(busy):
    before = snapshot(busy)
    # seq 1 holds 3 blocks of 4 = 12 slots; appending from slot 20 would leave a gap
    with pytest.raises(ValueError, match="without a gap"):
        busy.append_slots(1, 20, 24)
    expect_unchanged(busy, before)


def test_wrong_argument_types_raise_type_error(busy):
    before = snapshot(busy)
    with pytest.raises(TypeError):
        busy.allocate(7, "not tokens")
    with pytest.raises(TypeError):
        busy.free("1")
    expect_unchanged(busy, before)
