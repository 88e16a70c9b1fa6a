"""A linear layer whose output is several named projections side by side (q/k/v, gate/up).

The loader concatenates the checkpoint's separate weights along the output axis once, so a step
runs one GEMM instead of three (or two). `FusedLinear` remembers where each projection lives in
the fused output, so code that must touch one projection (splitting q/k/v, adding a LoRA delta to
`v` only) addresses it by name instead of restating the offsets.
"""

from __future__ import annotations

from torch import Tensor, nn


class FusedLinear(nn.Linear):
    """`nn.Linear(in_features, sum(sizes))` whose output columns are the named projections in
    order. The parameters keep `nn.Linear`'s names (`weight`, `bias`) and layout."""

    def __init__(self, in_features: int, sizes: dict[str, int], *, bias: bool) -> None:
        super().__init__(in_features, sum(sizes.values()), bias=bias)
        self.output_names = tuple(sizes)
        self.output_sizes = tuple(sizes.values())
        self.output_slices: dict[str, slice] = {}
        start = 0
        for name, size in sizes.items():
            self.output_slices[name] = slice(start, start + size)
            start += size

    def split(self, out: Tensor) -> tuple[Tensor, ...]:
        """The projections' views of a fused output `[..., out_features]`, in order."""
        return out.split(self.output_sizes, dim=-1)

    def part(self, out: Tensor, name: str) -> Tensor:
        """One projection's view of a fused output `[..., out_features]`."""
        return out[..., self.output_slices[name]]

    def extra_repr(self) -> str:
        parts = ", ".join(f"{n}={s}" for n, s in zip(self.output_names, self.output_sizes))
        return f"{super().extra_repr()}, outputs=({parts})"
