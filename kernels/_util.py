"""Small launch helpers shared by the Triton wrappers (imports nothing heavy)."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # float32 caches (tests, debugging) get exact products; on GPU "tf32" would lose ~3 digits.
    # fp16/bf16 operands ignore this and use the tensor cores natively.
    return "ieee" if dtype == torch.float32 else "tf32"
