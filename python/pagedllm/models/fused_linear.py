"""A linear layer whose output is several named projections side by side (q/k/v, gate/up).

The loader concatenates the checkpoint's separate weights along the output axis once, so a step
runs one GEMM instead of three (or two). `FusedLinear` remembers where each projection lives in
the fused output, so code that must touch one projection (splitting q/k/v, adding a LoRA delta to
`v` only) addresses it by name instead of restating the offsets.
"""

from __future__ import annotations

from pagedllm.distributed.layers import ColumnParallelLinear, TPShard

# one rank: the whole output
SINGLE = TPShard(rank=0, size=1)


class FusedLinear(ColumnParallelLinear):
    """`nn.Linear(in_features, sum(sizes))` whose output columns are the named projections in
    order (`split`, `part`, `output_slices`). The parameters keep `nn.Linear`'s names (`weight`,
    `bias`) and layout."""

    def __init__(self, in_features: int, sizes: dict[str, int], *, bias: bool) -> None:
        super().__init__(in_features, sizes, SINGLE, bias=bias)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{n}={s}" for n, s in zip(self.output_names, self.output_sizes))
        return f"{super().extra_repr()}, outputs=({parts})"
