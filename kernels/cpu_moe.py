"""The mixture-of-experts products on the CPU through the grouped Rust kernel
(`pagedllm._core.cpu_moe_experts`, `rust/src/cpu/moe.rs`).

A step's tokens are grouped by expert; each chosen expert's gate/up and down weights are read
once, as the linear kernel's column panels (`kernels/cpu_linear.py`), for all its tokens; the
weighted sum of a token's experts is written to its output row. Experts no token chose are never
read: at decode a token reads only its k experts, the floor of the bytes a step must move.
Each expert's panels are grouped as the linear kernel's are (`cpu_linear.grouped`): a decode
step reads a group of 4 as one stream of memory.
float32 and bfloat16; and experts kept in their GGUF types (`QuantExperts`, the quantized
products of `rust/src/cpu/quant/` per chosen expert).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from pagedllm import _core
from pagedllm.kernels.cpu_arrays import KERNEL_DTYPES, numpy_view
from pagedllm.kernels.cpu_linear import PANEL, grouped, plain

# an expert id the kernel skips (as does the torch reference): a choice of an expert another
# expert-parallel rank holds, whose term that rank adds
NOT_HELD = -1


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's gate/up `[2I, H]` and down `[H, I]` weights as column panels."""

    gate_up: Tensor  # [E, ceil(2I / PANEL) / G, H, G * PANEL] (G = 1: plain panels)
    down: Tensor  # [E, ceil(H / PANEL) / G, I, G * PANEL]
    width: int  # I, one expert's intermediate width
    hidden: int  # H
    gate_up_array: np.ndarray  # the panels as numpy (bfloat16 as uint16 bits), made once
    down_array: np.ndarray


def packable(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in KERNEL_DTYPES and weight.numel() > 0


def _panels(stacked: Tensor) -> Tensor:
    # [E, N, K] -> [E, ceil(N / PANEL), K, PANEL], each expert's last panel padded with zeros,
    # in the groups the kernel reads fastest (`cpu_linear.grouped`)
    experts, n, k = stacked.shape
    num_panels = -(-n // PANEL)
    padded = stacked.detach().new_zeros(experts, num_panels * PANEL, k)
    padded[:, :n] = stacked.detach()
    return grouped(padded.view(experts, num_panels, PANEL, k).transpose(2, 3))


def _unpanel(panels: Tensor, n: int) -> Tensor:
    panels = plain(panels)
    experts, num_panels, k, _ = panels.shape
    return panels.transpose(2, 3).reshape(experts, num_panels * PANEL, k)[:, :n].clone()


def pack_experts(gate_up: Tensor, down: Tensor) -> PackedExperts:
    """gate_up `[E, 2I, H]`, down `[E, H, I]` as the kernel's panels."""
    gu, dn = _panels(gate_up), _panels(down)
    return PackedExperts(gu, dn, down.shape[2], down.shape[1], numpy_view(gu), numpy_view(dn))


def unpack_experts(packed: PackedExperts) -> tuple[Tensor, Tensor]:
    """(gate_up `[E, 2I, H]`, down `[E, H, I]`) back from the panels (copies)."""
    return _unpanel(packed.gate_up, 2 * packed.width), _unpanel(packed.down, packed.hidden)


# The most buffers a call borrows: experts whose segments lie in more separate runs of memory
# (sliced for tensor parallelism, or made one by one) are copied into one buffer instead.
MAX_BUFFERS = 8


@dataclass(frozen=True)
class QuantExperts:
    """Every expert's gate/up `[2I, H]` and down `[H, I]` weights kept in their GGUF types
    (`cpu_quant.QuantWeight`s), registered with the kernel (`_core.CpuMoeQuantExperts`) as the
    few runs of memory their segments lie in: a GGUF file's stacked `ffn_{gate,up,down}_exps`
    tensors as they are mapped (each expert a contiguous block of them; no copy, so processes
    mapping the file share its page cache), or, where the segments are scattered over more than
    `MAX_BUFFERS` runs, one copy of them back to back (then `gate_up` / `down` are views of it).
    A call borrows those few buffers, where a segment array per expert cost ~7 % of a Q8_0
    decode step at 64 experts."""

    gate_up: list  # QuantWeight per expert
    down: list
    buffers: tuple  # the uint8 arrays the kernel reads
    kernel: _core.CpuMoeQuantExperts = field(repr=False)

    @classmethod
    def of(cls, gate_up: list, down: list) -> QuantExperts:
        hidden = gate_up[0].in_features if gate_up else 0
        tensors = [s.data for w in [*gate_up, *down] for s in w.segments]
        runs = _runs(tensors)
        if len(runs) > MAX_BUFFERS:
            _, gate_up, down = _copy(gate_up, down)
            tensors = [s.data for w in [*gate_up, *down] for s in w.segments]
            runs = _runs(tensors)
        buffers = tuple(_span(first, nbytes) for first, _, nbytes in runs)
        for buffer in buffers:
            _touch(buffer)
        place = _placements(runs)
        kernel = _core.CpuMoeQuantExperts(
            list(buffers),
            [[place(s) for s in w.segments] for w in gate_up],
            [[place(s) for s in w.segments] for w in down],
            hidden,
            tuple(tensors),  # they own the memory the buffers view
        )
        return cls(gate_up, down, buffers, kernel)

    @property
    def nbytes(self) -> int:
        """The bytes of every expert's segments."""
        return sum(s.data.numel() for w in [*self.gate_up, *self.down] for s in w.segments)

    def onto(self, buffer: Tensor, repack: bool = False) -> QuantExperts:
        """The same experts copied into `buffer` (uint8, 1-D, `nbytes` long: e.g. memory on
        huge pages, which the decode rows stream ~1.15-1.2x faster than a mapped file's 4 KiB
        pages, benches/RESULTS.md round 8 H3), back to back; with `repack`, rows of a type the
        products read faster in another layout are written in it (`_core.cpu_quant_repack`: the
        same bytes a row, the same results bit for bit), as the dense weights' are."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != self.nbytes:
            raise ValueError(
                f"the experts' copy needs a uint8 [{self.nbytes}] buffer, got {buffer.dtype} "
                f"{list(buffer.shape)}"
            )
        return QuantExperts.of(*_copy(self.gate_up, self.down, buffer, repack)[1:])


def _runs(tensors: list[Tensor]) -> list[tuple[Tensor, int, int]]:
    """The runs of memory the non-empty tensors cover, each `(its lowest tensor, first address,
    bytes)`: tensors back to back in memory (the experts of one GGUF tensor) make one run."""
    runs: list[tuple[Tensor, int, int]] = []
    for t in sorted((t for t in tensors if t.numel()), key=Tensor.data_ptr):
        start = t.data_ptr()
        if runs and runs[-1][1] + runs[-1][2] == start:
            first, at, nbytes = runs[-1]
            runs[-1] = (first, at, nbytes + t.numel())
        elif not (runs and runs[-1][1] <= start < runs[-1][1] + runs[-1][2]):
            runs.append((t, start, t.numel()))
        elif start + t.numel() > runs[-1][1] + runs[-1][2]:  # overlaps a run's end
            first, at, _ = runs[-1]
            runs[-1] = (first, at, start + t.numel() - at)
    return runs


def _span(first: Tensor, nbytes: int) -> np.ndarray:
    """A read-only uint8 array over `nbytes` from `first`'s first byte: every byte of it belongs
    to one of the run's tensors (`_runs`), which the kernel object keeps alive."""
    return np.lib.stride_tricks.as_strided(
        first.numpy().reshape(-1), shape=(nbytes,), strides=(1,), writeable=False
    )


def _touch(buffer: np.ndarray) -> None:
    """Reads a byte of every page of `buffer` once: a mapped file's pages are mapped into the
    process at load (as the copy they replace was written at load), not faulted in one by one by
    the first steps that choose each expert."""
    int(buffer[:: mmap.PAGESIZE].sum(dtype=np.uint64))


def _placements(runs: list[tuple[Tensor, int, int]]):
    """segment -> `(type code, rows, buffer index, byte offset)` in the runs' buffers."""

    def place(segment) -> tuple[int, int, int, int]:
        start = segment.data.data_ptr()
        for b, (_, at, nbytes) in enumerate(runs):
            if at <= start < at + nbytes:
                return (segment.qtype, segment.rows, b, start - at)
        return (segment.qtype, segment.rows, 0, 0)  # no rows: nothing is read

    return place


def _copy(
    gate_up: list, down: list, buffer: Tensor | None = None, repack: bool = False
) -> tuple[Tensor, list, list]:
    """(every weight's segments' bytes back to back as one uint8 tensor, `buffer` if given, the
    weights as views of it; with `repack`, each segment in its repacked layout where its type
    has one)."""
    from pagedllm.kernels.cpu_quant import QuantSegment, QuantWeight

    weights = [*gate_up, *down]
    flat = [s.data.reshape(-1) for w in weights for s in w.segments]
    if buffer is None:
        buffer = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    elif flat and not repack:
        torch.cat(flat, out=buffer)
    views, at = [], 0
    for w in weights:
        segments = []
        for s in w.segments:
            n = s.data.numel()
            dst = buffer[at : at + n].view(s.data.shape)
            qtype = _repacked(s, dst, w.in_features) if repack else s.qtype
            segments.append(QuantSegment(qtype, dst, s.rows))
            at += n
        views.append(QuantWeight(tuple(segments), w.in_features))  # checked when first made
    return buffer, views[: len(gate_up)], views[len(gate_up) :]


def _repacked(segment, dst: Tensor, in_features: int) -> int:
    """Writes `segment`'s rows into `dst` repacked where its type has a faster layout (else
    copied) and returns the type code of what was written."""
    if segment.data.numel():
        code = _core.cpu_quant_repack(segment.qtype, segment.data.numpy(), in_features, dst.numpy())
        if code is not None:
            return code
        dst.copy_(segment.data)
    return segment.qtype


def moe_quant_experts(
    x: Tensor, experts: QuantExperts, weights: Tensor, ids: Tensor, activations: str = "f32"
) -> Tensor:
    """`moe_experts` for float32 x over quantized experts (`CpuMoeQuantExperts.run`): each
    chosen expert's tokens through the quantized products, multiplying x as `activations`
    (`cpu_quant`'s "f32", "int8", "int16") says."""
    if x.dtype != torch.float32:
        raise TypeError(f"quantized experts take float32 activations, got {x.dtype}")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(rows)
    experts.kernel.run(
        rows.numpy(),
        numpy_view(ids.to(torch.int64).reshape(rows.shape[0], -1).contiguous()),
        numpy_view(weights.to(torch.float32).reshape(rows.shape[0], -1).contiguous()),
        out.numpy(),
        torch.get_num_threads(),
        activations,
    )
    return out.view(x.shape)


def moe_experts(x: Tensor, packed: PackedExperts, weights: Tensor, ids: Tensor) -> Tensor:
    """x `[T, H]`, the router's weights `[T, k]` and expert ids `[T, k]` -> `[T, H]`:
    `sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with `e = ids[t, j]`, the
    terms added in ascending expert order in float32 and rounded once to x's dtype; a choice
    `NOT_HELD` adds nothing."""
    if x.dtype != packed.gate_up.dtype:
        raise TypeError(f"x dtype {x.dtype} does not match the experts' ({packed.gate_up.dtype})")
    rows = x.reshape(-1, packed.hidden).contiguous()
    out = torch.empty_like(rows)
    _core.cpu_moe_experts(
        numpy_view(rows),
        packed.gate_up_array,
        packed.down_array,
        numpy_view(ids.to(torch.int64).reshape(rows.shape[0], -1).contiguous()),
        numpy_view(weights.to(torch.float32).reshape(rows.shape[0], -1).contiguous()),
        numpy_view(out),
        torch.get_num_threads(),
    )
    return out.view(x.shape)
