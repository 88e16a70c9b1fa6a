"""The KV cache's layer groups (vLLM's hybrid KV-cache layout): which block table each layer
reads and which of a block's layer slots holds its keys and values.

Layers of the same attention kind (full, or a sliding window of W tokens) share block tables.
A kind with more layers than the others is split into several groups of `layers_per_block`
layers, so that every group has (at most) that many layers: a cache block then holds one
group's layers (`[2, layers_per_block, blocks, ...]`), whichever group owns it, and the Rust
KV manager hands blocks of its one pool to any group. A sliding-window group keeps only the
blocks its window reads, so the same bytes hold more context. A window at least
`max_model_len` long is full attention. A model without windows is one group of every layer:
exactly the cache it had before groups.

The group size follows vLLM (`kv_cache_utils`): the fewest layers of any kind, or the most when
the kinds are within 25 % of each other (fewer groups, little padding).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVGroupLayout", "kv_group_layout"]


@dataclass(frozen=True)
class KVGroupLayout:
    """`windows`: each group's sliding window (None: full attention), full-attention groups
    first; `layer_group` / `layer_slot`: each layer's group and its slot in a block (the index
    into the cache's layer axis); `layers_per_block`: the cache's layer axis."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    layers_per_block: int

    @property
    def is_hybrid(self) -> bool:
        """More than one group, or a window: each group has its own block tables."""
        return self.windows != (None,)

    def describe(self) -> str:
        """One line for the start-up log and `get_stats()`."""
        kinds: dict[int | None, int] = {}
        for window in self.windows:
            kinds[window] = kinds.get(window, 0) + 1
        parts = [
            f"{n} x {'full' if w is None else f'window {w}'}"
            for w, n in sorted(kinds.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        ]
        return f"{len(self.windows)} groups ({', '.join(parts)}) of {self.layers_per_block} layers"


def kv_group_layout(
    layer_windows: tuple[int, ...], num_layers: int, max_model_len: int
) -> KVGroupLayout:
    """The layout of a model whose layer `i` has window `layer_windows[i]` (0: full attention;
    `()`: every layer full)."""
    kinds: dict[int | None, list[int]] = {}
    for i in range(num_layers):
        window = layer_windows[i] if layer_windows else 0
        kind = window if 0 < window < max_model_len else None
        kinds.setdefault(kind, []).append(i)
    if list(kinds) == [None]:
        layers = tuple(range(num_layers))
        return KVGroupLayout((None,), (0,) * num_layers, layers, num_layers)
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    windows: list[int | None] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    # full attention first: group 0's table is the one the step's `block_tables` carry
    for kind in sorted(kinds, key=lambda k: (k is not None, kinds[k][0])):
        layers = kinds[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(kind)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
