"""TEMPORARY (G2): until `kernels/cpu_quant.py` (G1) lands, the GGUF tests run the loader over a
reference stand-in of its contract (/work/notes/gguf_contract.md) built on the `gguf` package's
numpy (de)quantizers. Delete this file once `pagedllm.kernels.cpu_quant` imports."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import numpy as np
import torch


def _fallback_module() -> types.ModuleType:
    import gguf

    mod = types.ModuleType("pagedllm.kernels.cpu_quant")
    codes = (0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30)
    mod.SUPPORTED = frozenset(codes)
    mod.F32, mod.F16, mod.Q4_0, mod.Q4_1, mod.Q5_0, mod.Q5_1, mod.Q8_0 = codes[:7]
    mod.Q4_K, mod.Q5_K, mod.Q6_K, mod.BF16 = codes[7:]

    def block_shape(qtype):
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]

    @dataclass(frozen=True)
    class QuantSegment:
        qtype: int
        data: torch.Tensor
        rows: int

    @dataclass(frozen=True)
    class QuantWeight:
        segments: tuple
        in_features: int

        @property
        def out_features(self):
            return sum(s.rows for s in self.segments)

    def make_weight(segments, in_features):
        out = []
        for qtype, data in segments:
            if qtype not in mod.SUPPORTED:
                raise ValueError(f"unsupported type {qtype}")
            out.append(QuantSegment(qtype, data, data.shape[0]))
        return QuantWeight(tuple(out), in_features)

    def _rows(qtype, data, k):
        if qtype in (0, 1, 30):
            dt = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[qtype]
            return data.contiguous().view(dt).reshape(-1, k).float()
        values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(-1, k)

    def dequantize(w):
        return torch.cat([_rows(s.qtype, s.data, w.in_features) for s in w.segments])

    cache: dict[int, torch.Tensor] = {}

    def _dense(w):
        if id(w) not in cache:
            cache[id(w)] = dequantize(w)
        return cache[id(w)]

    def quant_linear(x, w, bias):
        return torch.nn.functional.linear(x, _dense(w), bias)

    def embedding(ids, w):
        return torch.nn.functional.embedding(ids, _dense(w))

    def quantize(weight, qtype):
        data = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType(qtype))
        return make_weight([(qtype, torch.from_numpy(data))], weight.shape[1])

    def row_bytes(qtype, k):
        block, nbytes = block_shape(qtype)
        if k % block:
            raise ValueError(f"{k} % {block}")
        return k // block * nbytes

    for name, value in dict(locals()).items():
        if callable(value) and not name.startswith("_") and name != "mod":
            setattr(mod, name, value)
    return mod


try:
    from pagedllm.kernels import cpu_quant

    cpu_quant.block_shape(8)  # the Rust side is built too
except (ImportError, AttributeError):
    sys.modules["pagedllm.kernels.cpu_quant"] = _fallback_module()
    import pagedllm.kernels

    pagedllm.kernels.cpu_quant = sys.modules["pagedllm.kernels.cpu_quant"]
