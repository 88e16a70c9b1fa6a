"""Paged attention on the CPU through the Rust kernels (`pagedllm._core.cpu_*`).

The kernels read each sequence's keys and values where they sit in the paged cache (no gather of
the context per layer and step, unlike the torch reference) and write the output in place. Torch
CPU tensors cross as numpy views of the same memory; the kernels release the GIL and use at most
torch's intra-op thread count (the calling thread and parked workers of a persistent pool), after
torch's own work of the layer has finished, while torch's OpenMP workers sleep (the passive wait
policy, `worker/cpu_threads.py`), so the two never compete for cores. float32 and bfloat16 (the
kernels compute in float32 either way); other dtypes take the torch reference path. The cache is
of q's dtype, or quantized (int8, fp8: `kernels.reference`'s row format, codes then the row's
scale), coded by the store as it writes and dequantized in registers by the attention.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pagedllm import _core
from pagedllm.kernels.cpu_arrays import NUMPY_DTYPE, kernel_dtype, numpy_view
from pagedllm.kernels.reference import kv_format


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the Rust kernels handle these tensors (float32 or bfloat16 on the CPU, the cache
    of q's dtype, bfloat16 or quantized, and contiguous)."""
    return (
        q.device.type == "cpu"
        and kernel_dtype(q.dtype)
        and (k_cache.dtype in (q.dtype, torch.bfloat16) or kv_format(k_cache.dtype) != "auto")
        and k_cache.is_contiguous()
    )


def _cache_view(cache: Tensor) -> np.ndarray:
    """A cache's memory as numpy: float caches as `numpy_view`, fp8 codes as their uint8 bits
    (numpy has no fp8), int8 as int8."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8).numpy()
    return numpy_view(cache)


def step_arrays(meta) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """slot_mapping (int64), query_start_loc, seq_lens, block_tables (int32) as contiguous
    numpy arrays, the dtypes the kernels take (converted only if the tensors differ)."""
    return (
        _array(meta.slot_mapping, np.int64),
        _array(meta.query_start_loc, np.int32),
        _array(meta.seq_lens, np.int32),
        _array(meta.block_tables, np.int32),
    )


def _array(t: Tensor, dtype) -> np.ndarray:
    return np.ascontiguousarray(numpy_view(t.cpu()), dtype=dtype)


def store_and_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    key_feedback: Tensor | None = None,
) -> Tensor:
    """Store k/v `[T, KVH, D]` at their slots, then attend q `[T, H, D]` -> `[T, H, D]` (a
    query sees the last `sliding_window` positions when that is > 0; scores capped at
    `softcap` when that is > 0; `key_feedback`: keys coded by error feedback)."""
    slots, query_start_loc, seq_lens, block_tables = arrays
    kc, vc = _cache_view(k_cache), _cache_view(v_cache)
    kv_dtype = kv_format(k_cache.dtype)
    feedback = None if key_feedback is None else key_feedback.numpy()
    _core.cpu_store_kvcache(numpy_view(k), numpy_view(v), kc, vc, slots, kv_dtype, feedback)
    # allocated on the numpy side and shared with torch: no dispatcher ops for the bridge
    # (bfloat16: one, the view of the uint16 bits as bfloat16)
    out = np.empty(q.shape, dtype=NUMPY_DTYPE[q.dtype])
    _core.cpu_paged_attention(
        numpy_view(q),
        kc,
        vc,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        out,
        torch.get_num_threads(),
        kv_dtype,
        sliding_window,
        softcap,
    )
    out = torch.from_numpy(out)
    return out if out.dtype == q.dtype else out.view(q.dtype)
