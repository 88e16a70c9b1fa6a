"""Triton kernels over the paged KV cache, each with a pure-torch reference.

Shipped inside the wheel as `pagedllm.kernels` (python/pagedllm/kernels is a
symlink to this folder).
"""
