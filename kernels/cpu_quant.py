"""Linear layers, embeddings and dequantization over weights kept in their GGUF (ggml) types,
for the Rust kernels (`pagedllm._core.cpu_quant_*`, `rust/src/cpu/quant/`).

A weight `[out_features, in_features]` is a tuple of row segments, each of one ggml type, its
bytes as the file stores them (`uint8 [rows, row_bytes]`, possibly a view of the mmap'd file):
fused projections of a Q4_K_M file mix types. `quant_linear` multiplies float32 activations by
the weights dequantized on the fly with float32 sums, so it equals `x @ dequantize(w).T` up to
summation order; one Rust call per layer, whatever the number of segments.

`quant_linear(..., activations=...)` may instead quantize decode rows of x (up to 8) per 32
elements and take integer dot products with the weights' codes: "int8" (8-bit codes, the
32-element block types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, as llama.cpp does: fastest, at a measured
cost in accuracy) or "int16" (16-bit codes, every quantized type, K-quants included: x's rounding
258 times finer). The engine's quantized layers pass `ACTIVATIONS`, read once at import from
`PAGEDLLM_QUANT_ACTIVATIONS` (default `DEFAULT_ACTIVATIONS`; benches/RESULTS.md, "16-bit
activations for the GGUF decode path", has the measurements behind it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import Tensor

from pagedllm import _core

# ggml type codes (GGML's own numbering, as gguf.GGMLQuantizationType)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
SUPPORTED: frozenset[int] = frozenset(
    {F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16}
)
# the types `quantize` writes (llama.cpp's reference rounding)
QUANTIZABLE: frozenset[int] = frozenset({Q8_0, Q4_0})

ACTIVATIONS_ENV = "PAGEDLLM_QUANT_ACTIVATIONS"
# how `quant_linear` may multiply decode rows of x: float32, or 8- / 16-bit codes
ACTIVATION_CHOICES = ("f32", "int8", "int16")
# what the engine's quantized layers use unless `ACTIVATIONS_ENV` says otherwise: 16-bit codes
# kept 99.95-100% of SmolLM2's teacher-forced top-1 predictions (Q8_0, Q4_K_M, Q4_0 files;
# perplexity within 0.001%) and ran decode-row products 1.1-1.9x faster than float32 activations
DEFAULT_ACTIVATIONS = "int16"


def activations_from_env() -> str:
    """The activations `ACTIVATIONS_ENV` asks the engine's quantized layers for (one of
    `ACTIVATION_CHOICES`; `DEFAULT_ACTIVATIONS` when unset); ValueError naming any other value."""
    value = os.environ.get(ACTIVATIONS_ENV, DEFAULT_ACTIVATIONS)
    if value not in ACTIVATION_CHOICES:
        choices = ", ".join(repr(c) for c in ACTIVATION_CHOICES)
        raise ValueError(
            f"{ACTIVATIONS_ENV}={value!r}: expected one of {choices} "
            f"(default {DEFAULT_ACTIVATIONS!r})"
        )
    return value


# what the engine's quantized layers pass as `activations`
ACTIVATIONS: str = activations_from_env()


def type_name(qtype: int) -> str:
    """The ggml name of a type code ("Q4_K"), or "type <code>" for a code ggml does not know."""
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _check_supported(qtype: int) -> None:
    if qtype not in SUPPORTED:
        names = ", ".join(type_name(t) for t in sorted(SUPPORTED))
        raise ValueError(
            f"unsupported ggml type {type_name(qtype)} ({qtype}); the CPU kernels take {names}"
        )


def block_shape(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type; F32 is (1, 4)."""
    _check_supported(qtype)
    return _core.cpu_quant_block_shape(qtype)


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` elements; ValueError unless that is whole blocks."""
    elems, size = block_shape(qtype)
    if in_features % elems:
        raise ValueError(
            f"{type_name(qtype)} rows hold whole blocks of {elems} elements; "
            f"{in_features} is not a multiple"
        )
    return in_features // elems * size


@dataclass(frozen=True)
class QuantSegment:
    """Rows of one ggml type, as stored in the file."""

    qtype: int
    data: Tensor  # uint8 [rows, row_bytes(qtype, in_features)], contiguous
    rows: int


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight `[out_features, in_features]` made of row segments."""

    segments: tuple[QuantSegment, ...]
    in_features: int
    # (type code, numpy view of the bytes) per segment: what each Rust call takes, made once
    _arrays: tuple[tuple[int, np.ndarray], ...] = field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        arrays = tuple((s.qtype, s.data.numpy()) for s in self.segments)
        object.__setattr__(self, "_arrays", arrays)

    @property
    def out_features(self) -> int:
        return sum(s.rows for s in self.segments)


def make_weight(segments: list[tuple[int, Tensor]], in_features: int) -> QuantWeight:
    """The weight of `(type code, uint8 [rows, row_bytes])` segments, checked: every type
    supported, every array 2-D uint8 of its type's row bytes (ValueError naming the segment)."""
    parts = []
    for i, (qtype, data) in enumerate(segments):
        _check_supported(qtype)
        want = row_bytes(qtype, in_features)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != want:
            raise ValueError(
                f"segment {i} ({type_name(qtype)}) must be uint8 [rows, {want}] for rows of "
                f"{in_features} elements, got {data.dtype} {list(data.shape)}"
            )
        if data.device.type != "cpu":
            raise ValueError(f"segment {i} is on {data.device}; the kernels read CPU memory")
        parts.append(QuantSegment(qtype, data.contiguous(), data.shape[0]))
    return QuantWeight(tuple(parts), in_features)


def quant_linear(
    x: Tensor, w: QuantWeight, bias: Tensor | None, *, activations: str = "f32"
) -> Tensor:
    """`x @ W.T (+ bias)`: float32 `x [..., in_features]` -> float32 `[..., out_features]`.
    `activations` (one of `ACTIVATION_CHOICES`): "f32" multiplies x as it is; "int8" / "int16"
    quantize up to 8 rows of x to 8- / 16-bit codes per 32 elements and multiply them by the
    rows the integer path takes (int8: the 32-element block types; int16: every quantized type)
    with integer dot products; other rows, and more rows of x, as "f32"."""
    if x.dtype != torch.float32:
        raise TypeError(f"quant_linear takes float32 activations, got {x.dtype}")
    if activations not in ACTIVATION_CHOICES:
        raise ValueError(f"activations {activations!r}: expected one of {ACTIVATION_CHOICES}")
    rows = x.reshape(-1, w.in_features).contiguous()
    out = torch.empty(rows.shape[0], w.out_features, dtype=torch.float32)
    _core.cpu_quant_linear(
        rows.detach().numpy(),
        w._arrays,
        None if bias is None else bias.detach().float().contiguous().numpy(),
        out.numpy(),
        torch.get_num_threads(),
        activations,
    )
    return out.view(*x.shape[:-1], w.out_features)


def dequantize(w: QuantWeight) -> Tensor:
    """The whole weight as float32 `[out_features, in_features]`."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
    _core.cpu_quant_dequantize(w._arrays, out.numpy())
    return out


def embedding(ids: Tensor, w: QuantWeight) -> Tensor:
    """Rows `ids` of the weight dequantized: float32 `[*ids.shape, in_features]`."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], w.in_features, dtype=torch.float32)
    _core.cpu_quant_embedding(flat.numpy(), w._arrays, out.numpy())
    return out.view(*ids.shape, w.in_features)


def quantize(weight: Tensor, qtype: int) -> QuantWeight:
    """A float weight `[N, K]` quantized to Q8_0 or Q4_0 with llama.cpp's reference rounding."""
    if qtype not in QUANTIZABLE:
        raise ValueError(f"quantizing to {type_name(qtype)} is not supported (Q8_0 and Q4_0 are)")
    if weight.dim() != 2:
        raise ValueError(f"the weight must be 2-D [N, K], got shape {list(weight.shape)}")
    n, k = weight.shape
    src = weight.detach().to(torch.float32).contiguous()
    out = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8)
    _core.cpu_quant_quantize(src.numpy(), qtype, out.numpy())
    return make_weight([(qtype, out)], k)


def _range(s: slice, length: int, what: str) -> tuple[int, int]:
    start, stop, step = s.indices(length)
    if step != 1:
        raise ValueError(f"{what} slices must have step 1, got {step}")
    return start, max(start, stop)


def slice_rows(w: QuantWeight, rows: slice) -> QuantWeight:
    """Output rows `rows` of the weight (views of the same bytes; column-parallel shards)."""
    start, stop = _range(rows, w.out_features, "row")
    parts = []
    first = 0
    for s in w.segments:
        lo, hi = max(start, first), min(stop, first + s.rows)
        if lo < hi:
            parts.append(QuantSegment(s.qtype, s.data[lo - first : hi - first], hi - lo))
        first += s.rows
    return QuantWeight(tuple(parts), w.in_features)


def slice_cols(w: QuantWeight, cols: slice) -> QuantWeight:
    """Input columns `cols` of the weight (row-parallel shards); ValueError unless both ends are
    on a block boundary of every segment's type. The bytes are copied (a row's part is strided)."""
    start, stop = _range(cols, w.in_features, "column")
    parts = []
    for s in w.segments:
        elems, size = block_shape(s.qtype)
        if start % elems or stop % elems:
            raise ValueError(
                f"columns {start}:{stop} cut {type_name(s.qtype)} blocks of {elems} elements; "
                "shards of a quantized weight must fall on block boundaries"
            )
        data = s.data[:, start // elems * size : stop // elems * size].contiguous()
        parts.append(QuantSegment(s.qtype, data, s.rows))
    return QuantWeight(tuple(parts), stop - start)
