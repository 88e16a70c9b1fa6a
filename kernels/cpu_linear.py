"""Linear layers on the CPU over weights reordered once, at load, for oneDNN's matmul.

`F.linear` on the CPU repacks the whole weight into the GEMM's blocked layout on every call
with more than one row: at decode batch sizes (2-16 rows) that copy costs as much as the
product itself, and a step's linear layers take ~1.7x the time of a product over a weight
packed once (benches/RESULTS.md, "Serving speed on CPU"). vLLM's CPU backend packs its weights
with oneDNN for the same reason. Packing needs torch's oneDNN (mkldnn) build and float32
weights (its bfloat16 path needs AVX-512 or AVX-NE-CONVERT); anything else keeps `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# the row count oneDNN picks the packed layout for (vLLM's choice too): decode batches and
# prefill chunks both run well on it
PACK_BATCH_HINT = 32


def packable(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0
        and torch.backends.mkldnn.is_available()
    )


def pack(weight: Tensor) -> Tensor:
    """`weight` `[out, in]` reordered for `linear` (an opaque oneDNN tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def unpack(packed: Tensor) -> Tensor:
    """The `[out, in]` weight back from its packed form (a copy)."""
    return packed.to_dense()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)`, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
