"""The weights the CPU products stream every decode step, moved into one buffer on transparent
huge pages at start-up.

A decode step reads every projection's weight once, front to back. On 4 KiB pages that stream
crosses a page every 4 KiB, each a TLB miss and a point where the hardware prefetcher stops: one
thread reads a panel-packed float32 weight at ~31 GB/s from 4 KiB pages and ~42 GB/s from 2 MiB
pages (benches/RESULTS.md, round 8, H2). torch allocates without asking for huge pages, and a GGUF
file's quantized rows are read in place from its mapping (page cache: 4 KiB pages), so the linear
layers' panels (`kernels.cpu_linear.PackedWeight`) and quantized rows
(`kernels.cpu_quant.QuantWeight`) are copied into one huge-page buffer (`host_zeros`) and the
layers pointed at the copies; the old memory is released (a file's page cache is left to the
kernel). The copies hold the same bytes: every result is unchanged.

A mixture of experts' float panels (`kernels.cpu_moe.PackedExperts`) and quantized experts
(`QuantExperts`) each get huge-page buffers of their own (bf16 Qwen3-MoE decode ~1.05-1.1x, round
14).

An embedding table is read a row per token, so it stays where it is, unless it is tied to the
LM head (one `QuantWeight` object), which reads it whole.

Quantized rows of a type the products read faster in another layout are written in that layout
instead of copied (`_core.cpu_quant_repack`: Q4_0, Q5_0, Q8_0 and Q4_1 at AVX-512 with VNNI,
repacked Q4_0 / Q5_0 / Q8_0 / Q4_1, the same bytes a row; `rust/src/cpu/quant/repack.rs`); the
products' results are the same bit for bit. A tied Q8_0 embedding follows its LM head into the
repacked layout (its rows are read back as Q8_0 a group at a time). A mixture of experts'
quantized experts are repacked likewise as they are copied into their own buffer.
`REPACK_ENV=0` copies them as they are (an A/B switch, read once at import).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm import _core
from pagedllm.distributed.layers import QuantEmbedding, VocabParallelEmbedding
from pagedllm.kernels.cpu_arrays import numpy_view
from pagedllm.kernels.cpu_linear import PackedWeight
from pagedllm.kernels.cpu_moe import PackedExperts, QuantExperts
from pagedllm.kernels.cpu_quant import QuantSegment, QuantWeight
from pagedllm.worker.cache_engine import HUGE_PAGE_BYTES, host_zeros

# tables read a row per token (moved only when tied to a layer that reads them whole)
EMBEDDINGS = (nn.Embedding, QuantEmbedding, VocabParallelEmbedding)
# each weight's start in the buffer: a cache line (the kernels' loads need no more)
ALIGN = 64
# "0": quantized rows copied as they are, never repacked
REPACK_ENV = "PAGEDLLM_WEIGHT_REPACK"
REPACK: bool = os.environ.get(REPACK_ENV, "1") != "0"
# the type codes of Q4_0 / Q5_0 / Q8_0 / Q4_1 rows repacked for the VNNI products (not ggml codes)
Q4_0_REPACKED = 1002
Q5_0_REPACKED = 1006
Q8_0_REPACKED = 1008
Q4_1_REPACKED = 1003


def move_weights(model: nn.Module) -> int:
    """Copies every CPU linear layer's packed or quantized weight of `model` into one huge-page
    buffer and points the layers (and a tied embedding) at the copies. Returns the bytes moved
    (0 when there is less than a huge page of them: nothing is moved)."""
    layers = [
        m for m in model.modules() if not isinstance(m, EMBEDDINGS) and _weight_of(m) is not None
    ]
    experts = _move_experts(model)  # a mixture of experts' quantized experts: their own buffer
    tensors: dict[int, torch.Tensor] = {}
    for module in layers:
        for t in _tensors(_weight_of(module)):
            tensors[id(t)] = t
    # each quantized segment's bytes: (type, row length), for the repack
    layouts = {
        id(s.data): (s.qtype, w.in_features)
        for w in map(_weight_of, layers)
        if isinstance(w, QuantWeight)
        for s in w.segments
    }
    total = sum(_aligned(t.nbytes) for t in tensors.values())
    if total < HUGE_PAGE_BYTES:
        return experts
    buffer = host_zeros((total,), torch.uint8)
    copies: dict[int, torch.Tensor] = {}
    retyped: dict[int, int] = {}  # a repacked segment's bytes: their new type code
    offset = 0
    for key, t in tensors.items():
        dst = buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        code = _repack(t, dst, *layouts[key]) if REPACK and key in layouts else None
        if code is None:
            dst.copy_(t)
        else:
            retyped[key] = code
        copies[key] = dst
        offset += _aligned(t.nbytes)
    moved: dict[int, object] = {}
    for module in [m for m in model.modules() if _weight_of(m) is not None]:
        weight = _weight_of(module)
        if id(weight) in moved or all(id(t) in copies for t in _tensors(weight)):
            if id(weight) not in moved:
                moved[id(weight)] = _copy(weight, copies, retyped)
            if isinstance(weight, PackedWeight):
                module.packed = moved[id(weight)]
            else:
                module.quant = moved[id(weight)]
    return total + experts


def _move_experts(model: nn.Module) -> int:
    """Copies each MoE layer's quantized experts (read in place from a GGUF file's mapping) into
    a huge-page buffer of their own (`cpu_moe.QuantExperts.onto`), and its float experts' panels
    (`cpu_moe.PackedExperts`, made by torch on 4 KiB pages) likewise; returns the bytes moved."""
    moved = 0
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, QuantExperts) and quant.nbytes >= HUGE_PAGE_BYTES:
            module.quant = quant.onto(host_zeros((quant.nbytes,), torch.uint8), REPACK)
            moved += quant.nbytes
        packed = getattr(module, "packed", None)
        if not isinstance(packed, PackedExperts):
            continue
        nbytes = packed.gate_up.nbytes + packed.down.nbytes
        if nbytes >= HUGE_PAGE_BYTES:
            module.packed = _experts_onto_pages(packed)
            moved += nbytes
    return moved


def _experts_onto_pages(packed: PackedExperts) -> PackedExperts:
    """The float experts' panels copied into memory on huge pages, each tensor its own
    (`host_zeros`): every chosen expert's panels are read front to back once a step."""
    copies = []
    for panels in (packed.gate_up, packed.down):
        copy = host_zeros(tuple(panels.shape), panels.dtype)
        copy.copy_(panels)
        copies.append(copy)
    gate_up, down = copies
    return PackedExperts(
        gate_up, down, packed.width, packed.hidden, numpy_view(gate_up), numpy_view(down)
    )


def _weight_of(module: nn.Module) -> PackedWeight | QuantWeight | None:
    quant = getattr(module, "quant", None)
    if isinstance(quant, QuantWeight):
        return quant
    packed = getattr(module, "packed", None)
    if isinstance(packed, PackedWeight) and packed.panels.device.type == "cpu":
        return packed
    return None


def _tensors(weight: PackedWeight | QuantWeight) -> list[torch.Tensor]:
    if isinstance(weight, PackedWeight):
        return [weight.panels]
    return [s.data for s in weight.segments]


def _repack(src: torch.Tensor, dst: torch.Tensor, qtype: int, in_features: int) -> int | None:
    """Writes the quantized rows `src` into `dst` in the layout the products read fastest and
    returns its type code, or None (nothing written) where the type stays as it is."""
    return _core.cpu_quant_repack(qtype, src.numpy(), in_features, dst.numpy())


def _copy(
    weight: PackedWeight | QuantWeight,
    copies: dict[int, torch.Tensor],
    retyped: dict[int, int],
):
    if isinstance(weight, PackedWeight):
        panels = copies[id(weight.panels)]
        return PackedWeight(panels, weight.out_features, numpy_view(panels))
    segments = tuple(
        QuantSegment(retyped.get(id(s.data), s.qtype), copies[id(s.data)], s.rows)
        for s in weight.segments
    )
    return QuantWeight(segments, weight.in_features)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
