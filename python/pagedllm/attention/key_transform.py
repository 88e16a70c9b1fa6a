"""A quantized KV cache's key transform: per (layer, kv head, channel), after RoPE, keys are
stored as `(k - c) * s` and queries meet them as `q / s` (`q * (1 / s)`).

`q / s . (k - c) * s = q . k - q . c`, and `q . c` is the same for every key a query sees, so
the softmax is unchanged: exact in float, with no correction term, and every part of the engine
(the stores, the CPU and Triton kernels, prefix caching, copy-on-write, swap, offload) sees
consistent rows without a change. What it buys is in the quantized rows: `s_c = (E q_c^2 /
E k_c^2)^(1/4)` spends a row's precision where the queries look, and the offset `c` (the keys'
mean) takes the channels' shared part out of the row's range (benches/RESULTS.md, rounds 8-9,
H4). The stored keys' codes are then chosen by error feedback (`feedback`, GPTQ's update on one
row against the calibration queries' second moments Sigma: the rounding error goes where the
queries do not look; benches/RESULTS.md, round 10 HD), and their scale byte searched (of four,
the one of least error under Sigma; round 12): only which codes and byte, not the row format,
so the decode side needs nothing of it. With soft-capped scores (Gemma 2) the shift `q . c`
would move scores before the cap: such a layer gets the scale alone (`offset` None), which keeps
scores exact.

The worker computes one per layer at start-up (`worker/kv_calibration.py`) and sets it on the
layer's `Attention` (`models/decoder.py`), which applies it where q and k leave RoPE; the fused
CPU decoder (`models/cpu_forward.py`) takes the same arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class KeyTransform:
    """One layer's transform: `scale` float32 `[KVH, D]` (s), `offset` float32 `[KVH, D]` (c)
    or None, `query_scale` float32 `[H, D]`: `1 / s` of each query head's kv head, and
    `feedback` float32 `[KVH, D, D]` or None: the stored keys' error-feedback rounding and
    scale search (`kernels/reference.py`'s `quantize_rows`; the decoded rows need nothing of it)."""

    scale: Tensor
    offset: Tensor | None
    query_scale: Tensor
    feedback: Tensor | None = None

    @classmethod
    def of(
        cls,
        scale: Tensor,
        offset: Tensor | None,
        num_heads: int,
        feedback: Tensor | None = None,
    ) -> KeyTransform:
        kv_heads = scale.shape[0]
        if num_heads % kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {kv_heads} kv heads")
        scale = scale.float().contiguous()
        recip = (1.0 / scale).repeat_interleave(num_heads // kv_heads, dim=0).contiguous()
        offset = None if offset is None else offset.float().contiguous()
        feedback = None if feedback is None else feedback.float().contiguous()
        return cls(scale, offset, recip, feedback)

    def apply_(self, q: Tensor, k: Tensor) -> None:
        """q `[T, H, D]`, k `[T, KVH, D]` transformed in place (views of the fused projection
        output too): `k = (k - c) * s`, `q = q * (1 / s)`, the order `forward.rs` repeats, so the
        fused decoder's rows equal these bit for bit."""
        if self.offset is not None:
            k.sub_(self.offset)
        k.mul_(self.scale)
        q.mul_(self.query_scale)
