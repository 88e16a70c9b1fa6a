"""The KV cache's layer groups (`attention/kv_groups.py`): which block table each layer reads and
which slot of a block holds its keys and values."""

from __future__ import annotations

from pagedllm.attention.kv_groups import kv_group_layout


def test_a_model_without_windows_is_one_group_of_every_layer():
    layout = kv_group_layout((), 4, 256)
    assert not layout.is_hybrid
    assert layout.windows == (None,)
    assert layout.layer_slot == (0, 1, 2, 3) and layout.layers_per_block == 4


def test_a_window_at_least_max_model_len_is_full_attention():
    layout = kv_group_layout((4096, 0, 4096), 3, 4096)
    assert not layout.is_hybrid and layout.layers_per_block == 3


def test_gemma3_pattern_splits_its_local_layers_into_groups_of_the_global_count():
    # 30 layers, every 6th global: 25 local (window 32) and 5 global -> groups of 5 layers
    windows = tuple(0 if i % 6 == 5 else 32 for i in range(30))
    layout = kv_group_layout(windows, 30, 4096)
    assert layout.windows == (None, 32, 32, 32, 32, 32)
    assert layout.layers_per_block == 5
    assert [layout.layer_group[i] for i in (5, 11, 29)] == [0, 0, 0]
    # each group's layers take distinct slots of a block
    for g in range(6):
        slots = [layout.layer_slot[i] for i in range(30) if layout.layer_group[i] == g]
        assert sorted(slots) == list(range(5))
    assert "5 x window 32" in layout.describe() and "1 x full" in layout.describe()


def test_kinds_within_a_quarter_of_each_other_are_one_group_each():
    # Gemma 2: alternating, 13 local and 13 global: two groups of 13 layers (vLLM's rule)
    windows = tuple(16 if i % 2 == 0 else 0 for i in range(26))
    layout = kv_group_layout(windows, 26, 1024)
    assert layout.windows == (None, 16) and layout.layers_per_block == 13


def test_every_layer_sliding_is_one_window_group():
    layout = kv_group_layout((16, 16), 2, 256)
    assert layout.is_hybrid and layout.windows == (16,)
    assert layout.layer_slot == (0, 1)
