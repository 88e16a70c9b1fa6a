"""The quantized KV cache's key calibration (`attention/key_transform.py`), computed once when
the worker starts, before the quantized cache is allocated.

A fixed, seeded set of random token ids (`PAGEDLLM_KV_CALIBRATION` of them, `DEFAULT_TOKENS`
unless set; 0 turns the calibration off) runs through the model over a float cache of its own, in
windows of at most `WINDOW` tokens. Each layer's attention records, where q and k leave RoPE,
the sums of k, k^2 per (kv head, channel) and of q^2 over the kv head's query heads; from them
the layer's key offset `c = E k` and key scale `s_c = (E q_c^2 / E k_c^2)^(1/4)` (the
Cauchy-Schwarz optimum of the score error under the rows' rotated, evenly spread error; scaled
so a head's rows keep their energy). The sums of `q q^T` per kv head give the second moments
`Sigma` of the queries as they meet a stored row (`H (q / s) / n`, rotated), and from them the
stores' error feedback: `U`, the upper Cholesky factor of `(Sigma + 0.01 mean(diag Sigma) I)^-1`,
each row divided by its diagonal (GPTQ's update on one row: the keys' rounding error is pushed
where the queries do not look; benches/RESULTS.md, round 10 HD), with `1 / U_jj^2` on its
diagonal (the coding errors' weights under Sigma: the stores search the scale byte by them).
Random ids, not real text: round 9's calibration on one real text failed another
(benches/RESULTS.md, Round 9, H4).

The moments of a head depend on that head only, so each tensor-parallel rank, running the same
forward on its shard, gets its heads' rows of the one-rank transform; every rank calibrates at
once (`Executor.start_workers`: the forward's collectives need them all). The worker holds the
result (`KeyCalibration`) and sets each layer's transform; its `digest` names it in a disk tier's
header, so blocks stored under another calibration (or none) are never loaded.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import xxhash
from torch import Tensor

from pagedllm.attention.key_transform import KeyTransform
from pagedllm.attention.paged import AttentionMetadata
from pagedllm.kernels.reference import hadamard
from pagedllm.models.decoder import Attention
from pagedllm.models.moe import SparseMoeBlock

logger = logging.getLogger("pagedllm")

ENV = "PAGEDLLM_KV_CALIBRATION"
DEFAULT_TOKENS = 4096
SEED = 0
WINDOW = 1024


@dataclass(frozen=True)
class KeyCalibration:
    """The transforms of the model's attention layers, in order, and what made them."""

    tokens: int
    transforms: tuple[KeyTransform, ...]
    seconds: float

    @property
    def digest(self) -> str:
        """xxh3-128 (hex) of every layer's scale and offset."""
        h = xxhash.xxh3_128()
        for t in self.transforms:
            h.update(t.scale.cpu().numpy().tobytes())
            h.update(b"-" if t.offset is None else t.offset.cpu().numpy().tobytes())
        return h.hexdigest()

    def describe(self) -> str:
        return f"{self.tokens} random token ids (seed {SEED})"


def calibration_tokens() -> int:
    """How many random token ids calibrate (`PAGEDLLM_KV_CALIBRATION`; 0: off)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_TOKENS
    if not raw.isdigit():
        raise ValueError(f"{ENV}={raw!r}: expected a number of token ids (0 turns it off)")
    return int(raw)


class Moments:
    """Stands in for a layer's transform during the calibration forward: records the sums,
    leaves q and k as they are."""

    feedback = None  # (the stores code as uncalibrated)

    def __init__(self) -> None:
        self.sums: list[Tensor] | None = None  # k, k^2, q^2 (float64 [KVH, D]), q q^T [KVH, D, D]
        self.count = 0

    def apply_(self, q: Tensor, k: Tensor) -> None:
        kv_heads = k.shape[1]
        k = k.double()
        q = q.double().reshape(q.shape[0], kv_heads, -1, q.shape[-1])
        qq = torch.einsum("tkgd,tkge->kde", q, q)
        sums = [k.sum(0), (k * k).sum(0), (q * q).sum((0, 2)), qq]
        self.sums = sums if self.sums is None else [a + b for a, b in zip(self.sums, sums)]
        self.count += k.shape[0]

    def transform(self, num_heads: int, *, offset: bool) -> KeyTransform:
        """The layer's transform from its moments (`offset`: with the key offset)."""
        k, k2, q2, qq = (s / self.count for s in self.sums)
        tiny = torch.finfo(torch.float32).tiny
        scale = (q2.clamp_min(tiny) / k2.clamp_min(tiny)) ** 0.25
        # a head's rows keep their energy: only the channels' shares move
        energy = k2.sum(-1, keepdim=True) / (scale * scale * k2).sum(-1, keepdim=True)
        scale = scale * energy.sqrt()
        feedback = error_feedback(qq, scale.float().double())
        return KeyTransform.of(scale, k if offset else None, num_heads, feedback)


def error_feedback(qq: Tensor, scale: Tensor) -> Tensor:
    """The stores' feedback matrices `[KVH, D, D]` (float32) from the queries' second moments
    `qq` `[KVH, D, D]` (as RoPE leaves them) and the key scale `s`: Sigma of `q / s` rotated as a
    stored row meets it, damped by 1 % of its mean diagonal; U = upper Cholesky factor of its
    inverse, rows divided by their diagonal, zero below it, and `1 / U_jj^2` on it (the weights
    that make the coding errors' sum the rows' error under Sigma: the stores' scale search)."""
    inv = 1.0 / scale
    sigma = qq * inv[:, :, None] * inv[:, None, :]
    d = sigma.shape[-1]
    h = hadamard(torch.eye(d, dtype=torch.float32)).double()
    sigma = h @ sigma @ h / float(d & -d) ** 2
    damp = 0.01 * torch.diagonal(sigma, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    damped = sigma + damp[:, None, None] * torch.eye(d, dtype=sigma.dtype)
    upper = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    diagonal = torch.diagonal(upper, dim1=-2, dim2=-1)
    feedback = torch.triu(upper / diagonal.unsqueeze(-1), diagonal=1)
    return (feedback + torch.diag_embed(1.0 / (diagonal * diagonal))).float().contiguous()


def calibrate(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    tokens: int,
    vocab_size: int,
) -> KeyCalibration | None:
    """Every attention layer's transform from `tokens` seeded random ids (None: no attention
    layer, or `tokens` 0). The layers' transforms are left unset."""
    layers = _attention_layers(model)
    if not layers or tokens <= 0:
        return None
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, (tokens,), generator=generator)
    window = min(WINDOW, max_model_len, tokens)
    blocks = -(-window // block_size)
    first = layers[0]
    cache = torch.zeros(
        (2, len(layers), blocks, block_size, first.num_kv_heads, first.head_dim),
        dtype=dtype,
        device=device,
    )
    moments = [Moments() for _ in layers]
    for layer, m in zip(layers, moments):
        layer.key_transform = m
    try:
        with torch.inference_mode():
            for begin in range(0, tokens, window):
                chunk = ids[begin : begin + window].to(device)
                positions = torch.arange(len(chunk), device=device)
                model(chunk, positions, cache, _meta(len(chunk), blocks, device))
    finally:
        for layer in layers:
            layer.key_transform = None
        for block in model.modules():
            if isinstance(block, SparseMoeBlock):
                block.expert_tokens.zero_()  # `get_stats` counts served tokens, not these
    transforms = tuple(
        m.transform(layer.num_heads, offset=not layer.softcap) for layer, m in zip(layers, moments)
    )
    calibration = KeyCalibration(tokens, transforms, time.perf_counter() - start)
    logger.info(
        "KV key calibration: %s through %d layers in %.2f s",
        calibration.describe(),
        len(layers),
        calibration.seconds,
    )
    return calibration


def _meta(n: int, blocks: int, device: torch.device) -> AttentionMetadata:
    """One sequence of `n` tokens at positions 0..n-1 in blocks 0..blocks-1."""

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        query_start_loc=t([0, n], torch.int32),
        seq_lens=t([n], torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        max_query_len=n,
        max_seq_len=n,
        is_decode_only=False,
    )


def set_transforms(model: torch.nn.Module, calibration: KeyCalibration | None) -> None:
    """Each attention layer's transform (None: none)."""
    for i, layer in enumerate(_attention_layers(model)):
        layer.key_transform = None if calibration is None else calibration.transforms[i]


def _attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's attention layers in order: the calibration's and the transforms' order."""
    return [m for m in model.modules() if isinstance(m, Attention)]
