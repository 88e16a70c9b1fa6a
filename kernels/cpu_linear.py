"""Linear layers on the CPU over weights packed once, at load, into column panels for the Rust
kernel (`pagedllm._core.cpu_linear`, `rust/src/cpu/linear.rs`).

At decode batch sizes the product is memory-bound: each weight is read once per step. The
panel layout `[ceil(N / 16), K, 16]` makes that read one sequential stream, and the same layout
serves prefill chunks (the kernel blocks them by rows and by K, BLIS-style), so each weight is
held once. `F.linear`
reads the `[N, K]` weight well at one row but repacks it into its GEMM's layout on every call
with more than one row; oneDNN's weight packed once is slower than the panels at 1-16 rows
(benches/RESULTS.md, "Serving speed on CPU"). float32 and bfloat16 weights are packed;
anything else keeps `F.linear`.

Where the kernel says so (`_core.cpu_panel_group`: bfloat16 on AVX-512 BF16) the panels are
stored in groups of 4 interleaved a pair of weight rows at a time (`grouped`), so that a decode
step reads a group as one stream of memory: the same products, ~1.2x the bandwidth of four
streams one panel apart on one core (benches/RESULTS.md, round 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedllm import _core
from pagedllm.kernels.cpu_arrays import KERNEL_DTYPES, numpy_view

# output columns per panel (`PANEL` in rust/src/cpu/linear.rs)
PANEL = 16


@dataclass(frozen=True)
class PackedWeight:
    """A weight `[out_features, in_features]` as the kernel's panels."""

    # [ceil(out_features / PANEL) / G, in_features, G * PANEL], the weight's dtype (`grouped`)
    panels: Tensor
    out_features: int
    array: np.ndarray  # the panels' memory as numpy (bfloat16 as its uint16 bits), made once


def packable(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in KERNEL_DTYPES
        and weight.dim() == 2
        and weight.numel() > 0
    )


def pack(weight: Tensor) -> PackedWeight:
    """`weight` `[out, in]` as column panels (the last padded with zeros)."""
    out_features, in_features = weight.shape
    num_panels = -(-out_features // PANEL)
    padded = weight.detach().new_zeros(num_panels * PANEL, in_features)
    padded[:out_features] = weight.detach()
    panels = grouped(padded.view(num_panels, PANEL, in_features).transpose(1, 2))
    return PackedWeight(panels, out_features, numpy_view(panels))


def unpack(packed: PackedWeight) -> Tensor:
    """The `[out, in]` weight back from its panels (a copy)."""
    panels = plain(packed.panels)
    num_panels, in_features, _ = panels.shape
    whole = panels.transpose(1, 2).reshape(num_panels * PANEL, in_features)
    return whole[: packed.out_features].clone()


def grouped(panels: Tensor) -> Tensor:
    """Panels `[..., P, K, PANEL]` in the groups the kernel reads fastest here
    (`_core.cpu_panel_group`): `[..., P / G, K, G * PANEL]`, each group `[K / 2, G, PANEL, 2]`
    (G panels side by side a pair of weight rows at a time, each pair column by column as the
    kernel multiplies it); contiguous."""
    *lead, p, k, _ = panels.shape
    g = _core.cpu_panel_group(str(panels.dtype).removeprefix("torch."), p, k)
    if g == 1:
        return panels.contiguous()
    pairs = panels.reshape(*lead, p // g, g, k // 2, 2, PANEL).transpose(-4, -3)
    return pairs.transpose(-2, -1).reshape(*lead, p // g, k, g * PANEL).contiguous()


def plain(panels: Tensor) -> Tensor:
    """`grouped` panels back as `[..., P, K, PANEL]`."""
    *lead, groups, k, width = panels.shape
    g = width // PANEL
    if g > 1:
        pairs = panels.reshape(*lead, groups, k // 2, g, PANEL, 2).transpose(-2, -1)
        panels = pairs.transpose(-4, -3)
    return panels.reshape(*lead, groups * g, k, PANEL)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight | None) -> Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    panels = packed.panels
    if x.dtype != panels.dtype:
        raise TypeError(f"input dtype {x.dtype} does not match the layer's weight ({panels.dtype})")
    rows = x.reshape(-1, panels.shape[1]).contiguous()
    out = torch.empty(rows.shape[0], packed.out_features, dtype=x.dtype)
    _core.cpu_linear(
        numpy_view(rows),
        packed.array,
        None if bias is None else numpy_view(bias.detach()),
        numpy_view(out),
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], packed.out_features)


def pack_linears(model: nn.Module) -> int:
    """Packs the weight of every module of `model` that has a `packed` slot (the engine's linear
    layers) and can be packed; the unpacked copy is dropped unless another parameter shares it
    (tied embeddings). Returns how many were packed."""
    shared = _shared_parameters(model)
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "packed") or weight is None or not packable(weight):
            continue
        module.packed = pack(weight)
        if id(weight) not in shared:
            # only `linear` reads it from now on; keep the dtype, free the memory
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        count += 1
    return count


def _shared_parameters(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, n in seen.items() if n > 1}
