"""Triton kernels over the paged KV cache, each with a pure-torch reference.

The kernel modules live in the repository's top-level `kernels/` folder; this package folder
holds this file and one symlink per module (`_tile.py -> ../../../kernels/_tile.py`, ...), which
the wheel ships as plain files (pyproject.toml's include glob). The top-level folder has no
`__init__.py`, so from the repository root `import kernels` runs none of our code and an
installed `kernels` (the Hugging Face kernel hub on PyPI) takes precedence over it.

Kernel entry points are resolved lazily: `pagedllm.kernels.reference` (the torch references and
the CPU path) must import on machines without triton, so triton is only imported when a kernel
name is first accessed.
"""

from __future__ import annotations

from pagedllm._lazy import lazy_names

# public name -> submodule defining it (module names differ from function names so that importing
# a submodule, which sets it as a package attribute, never shadows a function)
_LAZY = {
    "store_kvcache": "store_kv",
    "paged_decode_attention": "decode_attention",
    "choose_num_splits": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "copy_blocks": "block_copy",
    "lora_shrink": "lora",
    "lora_expand": "lora",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_names(__name__, _LAZY, also=["reference"])
