"""How torch CPU tensors cross into the Rust kernels (linear, RMS norm, attention, rotary): the
dtypes the kernels take, and a numpy view of a tensor's memory (no copy). numpy has no bfloat16,
so bfloat16 crosses as its uint16 bits; the kernels compute in float32 either way."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# kernel dtype -> the numpy dtype its tensors cross as
NUMPY_DTYPE = {torch.float32: np.float32, torch.bfloat16: np.uint16}
KERNEL_DTYPES = tuple(NUMPY_DTYPE)


def kernel_dtype(dtype: torch.dtype) -> bool:
    """Whether the Rust CPU kernels take tensors of this dtype."""
    return dtype in NUMPY_DTYPE


def numpy_view(t: Tensor) -> np.ndarray:
    """The CPU tensor's memory as numpy, no copy (detached first only when autograd tracks it)."""
    if t.requires_grad:
        t = t.detach()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()
