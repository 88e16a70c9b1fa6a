"""`PoolingParams` (vLLM's name): what one pooling request asks beyond its prompt."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.pooling.config import PoolerConfig


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the embedding's first `dimensions` values (a Matryoshka model only;
    normalized again after the cut when the model normalizes). None: all of them."""

    dimensions: int | None = None

    def check(self, config: PoolerConfig, hidden_size: int) -> None:
        """ValueError naming `dimensions` when the model cannot give that many."""
        dims = self.dimensions
        if dims is None:
            return
        if config.task != "embed":
            raise ValueError("dimensions: only an embedding model takes dimensions")
        if not config.matryoshka:
            raise ValueError(
                "dimensions: this model does not support Matryoshka representations (its "
                "config.json sets neither is_matryoshka nor matryoshka_dimensions)"
            )
        allowed = config.matryoshka_dimensions
        if isinstance(dims, bool) or not isinstance(dims, int) or not 0 < dims <= hidden_size:
            raise ValueError(f"dimensions must be an integer in [1, {hidden_size}], got {dims!r}")
        if allowed is not None and dims not in allowed:
            raise ValueError(f"dimensions must be one of {list(allowed)}, got {dims}")
