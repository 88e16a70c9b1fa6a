"""Whether this process multiplies bf16 weights with AVX-512 BF16's tiles: the only ones that
read grouped panels, shared by the linear and MoE kernel tests."""

from __future__ import annotations

from pagedllm import _core


def avx512_bf16() -> bool:
    level, flags = _core.cpu_isa()
    return level in ("avx512", "amx") and "avx512bf16" in flags
