"""Hybrid KV groups through the scheduler's Python API: a sliding-window group holds only
the blocks its window reads, and a Gemma-3-shaped layout holds at most a quarter of what
full attention holds."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm._core import PagedLLMError

from scheduler_util import all_blocks_free, make, prompt, step


def held_blocks(s, seq_id: int) -> int:
    """Blocks sequence `seq_id` holds, every group (released ones are -1)."""
    return sum(
        sum(1 for b in s.group_block_table(seq_id, g) if b >= 0) for g in range(len(s.kv_groups))
    )


def test_a_window_group_keeps_only_its_window_blocks_while_decoding():
    s = make(num_gpu_blocks=128, max_model_len=256)
    s.set_kv_groups([None, 8])
    s.add_request("r", prompt(0, 10), max_tokens=60)
    for _ in range(40):
        out, _ = step(s)
        seq = int(out.seq_ids[0])
        full, window = s.group_block_table(seq, 0), s.group_block_table(seq, 1)
        assert list(out.block_tables[0][: len(full)]) == full
        assert len(window) == len(full)
        # Window 8 over blocks of 4: at most 3 blocks of keys, plus the one just opened.
        assert sum(b >= 0 for b in window) <= 4
    assert window[0] == -1
    while s.has_unfinished_requests():
        step(s)
    assert all_blocks_free(s)


def test_kv_groups_refuse_a_zero_window_and_a_late_call():
    s = make(num_gpu_blocks=16)
    with pytest.raises(ValueError, match="group 1"):
        s.set_kv_groups([None, 0])
    s.add_request("r", prompt(0, 4), max_tokens=2)
    with pytest.raises(PagedLLMError, match="before any request"):
        s.set_kv_groups([None, 8])


def run_3k_tokens(groups: list[int | None]) -> int:
    """Blocks held after a ~3k-token prompt (512-token chunks) and 32 decoded tokens."""
    s = make(
        num_gpu_blocks=4096,
        block_size=16,
        max_model_len=4096,
        max_num_batched_tokens=512,
        scheduling="chunked_prefill",
    )
    s.set_kv_groups(groups)
    s.add_request("r", prompt(0, 3072), max_tokens=64)
    for _ in range(6 + 32):
        out, _ = step(s)
    return held_blocks(s, int(out.seq_ids[0]))


def test_a_gemma3_layout_holds_at_most_a_quarter_of_full_attention_blocks():
    gemma3 = [32] * 5 + [None]  # 5 local (window 32) : 1 global layer groups
    local, full = run_3k_tokens(gemma3), run_3k_tokens([None] * 6)
    assert full >= 6 * 3072 // 16
    assert local * 4 <= full, (local, full)


def test_a_step_carries_each_groups_tables_and_slots():
    s = make(num_gpu_blocks=128, max_model_len=256)
    s.set_kv_groups([None, 8])
    s.add_request("r", prompt(0, 10), max_tokens=30)
    for _ in range(20):
        out = s.schedule()
        seq = int(out.seq_ids[0])
        tables, slots = out.kv_group_tables, out.kv_group_slots
        assert tables.shape[:2] == (2, 1) and slots.shape == (2, out.num_batched_tokens)
        for g in range(2):
            row = s.group_block_table(seq, g)
            assert list(tables[g, 0, : len(row)]) == row
            # the step's tokens are written to blocks the group holds
            assert all(int(slot) // 4 in row for slot in slots[g])
        assert list(slots[0]) == list(out.slot_mapping)
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
    assert -1 in list(tables[1, 0])


def test_without_groups_a_step_carries_empty_group_arrays():
    s = make(num_gpu_blocks=32)
    s.add_request("r", prompt(0, 6), max_tokens=2)
    out, _ = step(s)
    assert out.kv_group_tables.shape == (0, 1, 0)
    assert out.kv_group_slots.shape == (0, 6)
