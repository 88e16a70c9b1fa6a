"""Pure-torch references for the paged-KV kernels.

These are the test oracles of the Triton kernels *and* the CPU execution path of the engine,
so they are vectorized (gather + padding, no per-token Python loops) and must not import triton.
Layout (docs/ARCHITECTURE.md §3): k_cache / v_cache are
`[num_blocks, block_size, kv_heads, head_dim]`, `kv_cache` is
`[2, layers, num_blocks, block_size, kv_heads, head_dim]`; slot = block * block_size + offset.

Quantized caches (`kv_cache_dtype` int8 / fp8_e4m3 / fp8_e5m2) store each (slot, kv head) row as
its `head_dim` codes followed by one scale byte, so their last dimension is `head_dim + 1`
(`KV_SCALE_BYTES`) elements of one byte. `quantize_rows` / `dequantize_rows` are the formats'
definition (the Rust and Triton stores code rows bit for bit as they do; `rust/src/cpu/kv_quant.rs`
says why):
- the row is rotated first, `H x` (`hadamard`: the Sylvester Hadamard matrix, entries +-1, over
  blocks of the largest power of two dividing `head_dim`); the kernels rotate q by `H q / n` and
  their output back, so attention is the unrotated rows'; `dequantize_rows` undoes the rotation;
- the scale byte codes the row's bound, the smallest at least the rotated row's amax: with 5
  mantissa bits from 2 to 256 (bytes 16-239: `(1 + m / 32) 2^(1 + e)` for `16 + (e << 5 | m)`),
  with 1 bit on the eight octaves either side (2^-7 to 2, 256 to 49152); below, the smallest, above,
  the largest (the codes then saturate); `scale = bound * float32(1 / max)`;
- int8: max 127, codes `round_half_even(x / scale)` in [-127, 127];
- fp8: max 448 (e4m3fn) or 57344 (e5m2), codes `x / scale` clamped to +-max and rounded to
  nearest even (torch's conversion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "KV_SCALE_BYTES",
    "kv_storage_dtype",
    "kv_format",
    "kv_row_size",
    "kv_row_format",
    "kv_code_max",
    "hadamard",
    "unrotate",
    "quantize_rows",
    "dequantize_rows",
    "as_bytes",
    "store_kvcache",
    "paged_attention",
    "AttentionPlan",
    "build_plan",
    "store_planned",
    "attend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
]


KV_SCALE_BYTES = 1
# the scale byte's bounds (`_bound_bits`): 5 mantissa bits over a band of 7 octaves from
# 2^_BAND (bytes 16-239), 1 bit over the 8 octaves on either side (0-15 below, 240-255 above)
_BAND = 1
# storage dtype of each quantized format (`kv_cache_dtype` name, "fp8" resolved) and the largest
# magnitude its codes reach
_KV_FORMATS = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
_KV_NAMES = {dtype: name for name, (dtype, _) in _KV_FORMATS.items()}
_KV_MAX = dict(_KV_FORMATS.values())
# the keys' scale bytes searched under error feedback in the fp8 formats (`quantize_rows`)
KEY_BYTES = 8


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a `kv_cache_dtype` ("auto": the model's; "bfloat16": a float
    cache of bfloat16 whatever the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    if name not in _KV_FORMATS:
        accepted = ["auto", "bfloat16", "fp8", *_KV_FORMATS]
        raise ValueError(f"kv_cache_dtype must be one of {accepted}, got {kv_cache_dtype!r}")
    return _KV_FORMATS[name][0]


def kv_format(cache_dtype: torch.dtype) -> str:
    """A cache tensor's format: "auto" (a float cache), "int8", "fp8_e4m3" or "fp8_e5m2"."""
    return _KV_NAMES.get(cache_dtype, "auto")


def kv_row_size(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one (slot, kv head) row of a cache of this dtype (a quantized row's scale
    after its codes)."""
    return head_dim + (KV_SCALE_BYTES if cache_dtype in _KV_NAMES else 0)


def kv_code_max(cache_dtype: torch.dtype) -> float:
    """The largest magnitude a quantized format's codes reach (a row's bound maps onto it)."""
    return _KV_MAX[cache_dtype]


def kv_row_format(cache_dtype: torch.dtype) -> str:
    """What a cache's rows are, for a stored block's header: a tier written with another row
    format (another dtype, or an earlier quantized layout) must not be loaded."""
    if cache_dtype not in _KV_NAMES:
        return str(cache_dtype).removeprefix("torch.")
    return f"{_KV_NAMES[cache_dtype]}:hadamard,codes,bound-byte-m5-2-256-m1-tails"


def hadamard(x: Tensor) -> Tensor:
    """`H x` over the last dimension, per block of its largest power-of-two divisor, as the Rust
    store's butterflies (the same float32 operations: bit for bit)."""
    d = x.shape[-1]
    n = d & -d
    shape = x.shape
    h = 1
    while h < n:
        x = x.reshape(*shape[:-1], d // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return x.reshape(shape)


def unrotate(x: Tensor) -> Tensor:
    """`H x / n`: a rotated row's values back (and a query rotated to meet rotated keys)."""
    d = x.shape[-1]
    return hadamard(x) * (1.0 / (d & -d))


def _bound_bits(byte: Tensor) -> Tensor:
    """The f32 bits (int64) of the bound each scale byte codes."""
    b = byte.long()
    low = ((_BAND - 8 + (b >> 1) + 127) << 23) | ((b & 1) << 22)
    band = ((_BAND + ((b - 16) >> 5) + 127) << 23) | (((b - 16) & 31) << 18)
    high = ((_BAND + 7 + ((b - 240) >> 1) + 127) << 23) | (((b - 240) & 1) << 22)
    return torch.where(b < 16, low, torch.where(b < 240, band, high))


def _bound_byte(amax: Tensor) -> Tensor:
    """The smallest scale byte whose bound is at least `amax` (float32 >= 0), as int32: amax's
    bits rounded up to 5 (in the band) or 1 (outside) mantissa bits, the carry moving into the
    exponent; below the smallest bound byte 0, above the largest 255 (the codes saturate)."""
    bits = amax.view(torch.int32).long()
    up5, up1 = (bits + (1 << 18) - 1) >> 18, (bits + (1 << 22) - 1) >> 22
    e5, e1 = (up5 >> 5) - 127, (up1 >> 1) - 127
    low = ((e1 - _BAND + 8) << 1) + (up1 & 1)
    band = 16 + ((e5 - _BAND) << 5) + (up5 & 31)
    high = 240 + ((e1 - _BAND - 7) << 1) + (up1 & 1)
    byte = torch.where(e5 < _BAND, low, torch.where(e5 < _BAND + 7, band, high))
    return byte.clamp(0, 255).int()


def _row_scale(byte: Tensor, cache_dtype: torch.dtype) -> Tensor:
    bound = _bound_bits(byte).int().view(torch.float32)
    return bound * torch.tensor(1 / _KV_MAX[cache_dtype], dtype=torch.float32)


def quantize_rows(x: Tensor, cache_dtype: torch.dtype, feedback: Tensor | None = None) -> Tensor:
    """Rows `[..., D]` (any float dtype) coded as `[..., D + 1]` of the quantized `cache_dtype`:
    the rotated row's codes, then its scale byte (see the module docstring).

    `feedback` (float32 `[KVH, D, D]`, rows `[..., KVH, D]`; the key calibration's): the codes
    chosen by error feedback (GPTQ's update on one row): channel by channel the code of the value
    so far, its error `e` (in the row's scale units) pushed onto the later channels as
    `w_l -= e * feedback[h, j, l]` (above the diagonal), and in the fp8 formats the scale byte
    searched: each of the `KEY_BYTES` bytes from the smallest bound >= amax up is coded so, the
    one of least weighted error `scale^2 * sum_j e_j^2 feedback[h, j, j]` kept (the first of
    equals; with `1 / U_jj^2` on the diagonal that is `delta^T Sigma delta`; a zero diagonal, or
    int8, keeps the first byte). Same row format; the Rust store (`KvElem::encode_fed`) repeats
    these float32 operations."""
    x = hadamard(x.float())
    byte = _bound_byte(x.abs().amax(-1, keepdim=True))
    limit = _KV_MAX[cache_dtype]

    def code(y: Tensor) -> Tensor:
        y = y.clamp(-limit, limit)
        return y.round().to(torch.int8) if cache_dtype == torch.int8 else y.to(cache_dtype)

    if feedback is None:
        codes = code(x / _row_scale(byte, cache_dtype))
    else:
        # the candidates side by side on a leading axis
        n = 1 if cache_dtype == torch.int8 else KEY_BYTES
        byte = (byte + torch.arange(n).view(-1, *[1] * x.dim())).clamp(max=255)
        scale = _row_scale(byte, cache_dtype)
        w, columns, err = x / scale, [], torch.zeros_like(scale)
        for j in range(w.shape[-1]):
            columns.append(code(w[..., j]))
            e = w[..., j] - columns[-1].float()
            err += (e * e * feedback[:, j, j]).unsqueeze(-1)
            w[..., j + 1 :] -= e.unsqueeze(-1) * feedback[:, j, j + 1 :]
        codes, err = torch.stack(columns, dim=-1), err * (scale * scale)
        pick = torch.zeros_like(byte[0], dtype=torch.long)
        for k in range(1, n):
            pick = torch.where(err[k] < err.gather(0, pick[None])[0], k, pick)
        byte = byte.gather(0, pick[None])[0]
        codes = codes.view(torch.uint8).gather(0, pick[None].expand_as(codes[:1]))[0]
    rows = torch.cat([codes.view(torch.uint8), byte.to(torch.uint8)], dim=-1)
    return rows.view(cache_dtype)


def dequantize_rows(rows: Tensor) -> Tensor:
    """float32 `[..., D]` of quantized rows `[..., D + 1]`, the rotation undone (a float cache's
    rows: as float32)."""
    if rows.dtype not in _KV_NAMES:
        return rows.float()
    raw = rows.view(torch.uint8)
    codes = raw[..., :-KV_SCALE_BYTES].view(rows.dtype)
    scale = _row_scale(raw[..., -KV_SCALE_BYTES:], rows.dtype)
    return unrotate(codes.float() * scale)


def store_kvcache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    key_feedback: Tensor | None = None,
) -> None:
    """Write k/v `[T, KVH, D]` into their slots; slot -1 marks padding and is skipped.
    `key_feedback`: a quantized cache's keys coded by error feedback (`quantize_rows`)."""
    keep = slot_mapping >= 0
    rows, slots = keep.nonzero().view(-1), slot_mapping[keep].long()
    _store(k, v, k_cache, v_cache, rows, slots, key_feedback)


def _store(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    rows: Tensor | None,
    slots: Tensor,
    key_feedback: Tensor | None = None,
) -> None:
    """k/v rows `rows` (None: all) into flat slots `slots` (int64, all valid)."""
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    # flatten (block, offset) into one slot axis; the caches are views of one contiguous tensor
    for x, cache, feedback in ((k, k_cache, key_feedback), (v, v_cache, None)):
        if cache.dtype in _KV_NAMES:
            rows = quantize_rows(x, cache.dtype, feedback)
        else:
            rows = x.to(cache.dtype)
        as_bytes(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, as_bytes(rows))


def as_bytes(t: Tensor) -> Tensor:
    """An fp8 tensor as its uint8 bits (torch has no CPU index_copy_ / index_put_ for fp8; a
    copy of bits is the same copy); other tensors as they are."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


# Bounds on the CPU path's temporaries: queries of one sequence are processed in chunks of at most
# _Q_CHUNK rows, and padded sub-batches hold at most _SCORE_BUDGET fp32 scores (64 MiB), so that a
# long prompt mixed with many decodes does not pad every decode row to the prompt's length.
_Q_CHUNK = 128
_SCORE_BUDGET = 1 << 24


@dataclass
class _SubBatch:
    """One padded batch of S query chunks, each over its own padded context of N keys."""

    S: int
    max_q: int
    ctx_slots: Tensor  # int64 [S * N] flat cache slot of each context position (padding: 0)
    N: int
    mask: Tensor  # float32 [S, 1, max_q, N]: 0 where the key is visible, -inf elsewhere
    q_rows: Tensor | None  # int64 [S * max_q] packed query row per padded query; None: identity
    out_src: (
        Tensor | None
    )  # int64 padded rows with a live query; None: identity (see AttentionPlan)
    out_dst: Tensor | None  # int64 packed destination rows of out_src
    # gather destinations reused by every layer of the step: a fresh multi-MiB tensor per layer and
    # cache costs page faults comparable to the attention itself
    bufs: tuple[Tensor, Tensor] | None = None


@dataclass
class AttentionPlan:
    """Everything about a step's attention that does not depend on the layer: store indices, the
    padded gather of each sub-batch, causal masks and the scatter back. Built once per step and
    reused by every layer (the index arithmetic costs more than the attention on small models)."""

    num_tokens: int
    store_rows: Tensor | None  # int64 token rows with a slot; None: every row
    store_slots: Tensor  # int64 their slots
    subs: list[_SubBatch]
    identity: bool  # one sub-batch whose padded rows are exactly the T packed rows, all live


def build_plan(
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    slot_mapping: Tensor | None,
    block_size: int,
    num_heads: int,
    num_tokens: int,
    device: torch.device,
    sliding_window: int = 0,
) -> AttentionPlan:
    """The per-step plan for `T = num_tokens` packed query rows (see `paged_attention`);
    `sliding_window` W > 0: a query sees only the last W positions."""
    if slot_mapping is None:
        store_rows, store_slots = None, torch.empty(0, dtype=torch.long, device=device)
    else:
        slots = slot_mapping.to(device, torch.long)
        keep = slots >= 0
        if bool(keep.all()):
            store_rows, store_slots = None, slots
        else:
            store_rows = keep.nonzero().view(-1)
            store_slots = slots.index_select(0, store_rows)
    S = seq_lens.numel()
    subs: list[_SubBatch] = []
    if S == 0 or num_tokens == 0:
        return AttentionPlan(num_tokens, store_rows, store_slots, subs, False)
    qsl = query_start_loc.to(device, torch.long)
    lens = seq_lens.to(device, torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    tables = block_tables.to(device, torch.long)
    max_ctx = tables.shape[1] * block_size  # a table narrower than the context truncates it

    # Split each sequence's queries into chunks [a, b) of <= _Q_CHUNK rows. A chunk behaves exactly
    # like a sequence of context L - q + b with b - a queries (same causal positions, fewer keys).
    n_chunks = (q_lens + _Q_CHUNK - 1) // _Q_CHUNK
    owner = torch.repeat_interleave(torch.arange(S, device=device), n_chunks)
    first = torch.cumsum(n_chunks, 0) - n_chunks
    a = (torch.arange(owner.numel(), device=device) - first[owner]) * _Q_CHUNK
    b = torch.minimum(a + _Q_CHUNK, q_lens[owner])
    c_start, c_qlen, c_len = qsl[owner] + a, b - a, lens[owner] - q_lens[owner] + b

    # decode-like chunks (1 query) and longer chunks are padded separately
    for group in (c_qlen == 1, c_qlen > 1):
        idx = group.nonzero().view(-1)
        if idx.numel() == 0:
            continue
        max_q = int(c_qlen[idx].max())
        max_n = min(max(1, int(c_len[idx].max())), max_ctx)
        per = max(1, _SCORE_BUDGET // (max_q * max_n * num_heads))
        if idx.numel() > per:
            # several sub-batches: group chunks of similar context so that short ones are not
            # padded to the longest (each sub-batch pads to its own longest context)
            idx = idx[torch.sort(c_len[idx], stable=True).indices]
        for i in range(0, idx.numel(), per):
            sub = idx[i : i + per]
            subs.append(
                _plan_sub(
                    tables[owner[sub]],
                    c_start[sub],
                    c_qlen[sub],
                    c_len[sub],
                    max_q,
                    block_size,
                    max_ctx,
                    num_tokens,
                    sliding_window,
                )
            )
    # out_src is None only for a sub-batch whose padded rows are exactly the T rows, so then it is
    # the only one
    identity = subs[0].out_src is None
    return AttentionPlan(num_tokens, store_rows, store_slots, subs, identity)


def _plan_sub(
    tables: Tensor,
    q_start: Tensor,
    q_lens: Tensor,
    lens: Tensor,
    max_q: int,
    bs: int,
    max_ctx: int,
    num_tokens: int,
    window: int = 0,
) -> _SubBatch:
    """Sequence s of the sub-batch has queries q[q_start[s] : q_start[s] + q_lens[s]] and context
    lens[s]."""
    dev = tables.device
    S = lens.numel()
    max_n = min(max(1, int(lens.max())), max_ctx)
    lens = lens.clamp(max=max_ctx)
    key_pos = torch.arange(max_n, device=dev)
    in_ctx = key_pos[None, :] < lens[:, None]  # [S, N]
    # flat slot of context position p: table[p // bs] * bs + p % bs; positions past the context
    # read slot 0 (any valid slot: they are masked), which also keeps padded table entries out of
    # the index
    slots = tables[:, key_pos // bs] * bs + key_pos % bs
    readable = in_ctx
    if window > 0:
        # blocks before the first query's window may have been freed: slot 0 instead
        readable = in_ctx & (key_pos[None, :] > (lens - q_lens - window)[:, None])
    ctx_slots = torch.where(readable, slots, 0).reshape(-1)

    # causal: query i of s sits at L_s - q_s + i and sees keys 0..that position (and < L_s)
    q_idx = torch.arange(max_q, device=dev)
    q_pos = (lens - q_lens)[:, None] + q_idx[None, :]  # [S, max_q]
    visible = (key_pos[None, None, :] <= q_pos[:, :, None]) & in_ctx[:, None, :]
    if window > 0:
        # sliding window (transformers' rule): keys less than W positions behind the query
        visible &= key_pos[None, None, :] > q_pos[:, :, None] - window
    visible = visible[:, None]
    # additive: SDPA would convert a boolean mask to this in every layer
    mask = torch.zeros(visible.shape, device=dev).masked_fill_(~visible, float("-inf"))

    # padded query (s, i) reads packed row q_start[s] + i; rows past q_lens[s] read a valid row and
    # are dropped. Only live rows (a real query with at least one visible key) are written back: the
    # others stay zero whatever the attention backend does with fully masked rows.
    real = q_idx[None, :] < q_lens[:, None]
    live = (real & (q_pos >= 0) & (lens[:, None] > 0)).reshape(-1)
    rows = (q_start[:, None] + torch.where(real, q_idx[None, :], 0)).reshape(-1)
    # the padded rows are the packed rows themselves (decode-only batch, equal-length prefills)
    dense = rows.numel() == num_tokens and bool(
        (rows == torch.arange(num_tokens, device=dev)).all()
    )
    q_rows = None if dense else rows
    out_src = out_dst = None
    if not (dense and bool(live.all())):
        out_src = live.nonzero().view(-1)
        out_dst = rows.index_select(0, out_src)
    return _SubBatch(S, max_q, ctx_slots, max_n, mask, q_rows, out_src, out_dst)


def store_planned(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    key_feedback: Tensor | None = None,
) -> None:
    """`store_kvcache` with the slot filtering of a prebuilt plan."""
    _store(k, v, k_cache, v_cache, plan.store_rows, plan.store_slots, key_feedback)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Attention of every query token over its sequence's paged context.

    q `[T, H, D]`; sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]` (length q_s)
    and has context length `seq_lens[s]` = L_s (its new tokens included, already stored in the
    cache). Query i of s sits at position L_s - q_s + i and sees keys 0..that position (with a
    `sliding_window` W > 0, only the last W of them); `softcap` as in `attend`.
    Rows beyond `query_start_loc[-1]` and queries without any visible key get zeros.
    Math in float32; result in q.dtype.
    """
    plan = build_plan(
        query_start_loc,
        seq_lens,
        block_tables,
        None,
        k_cache.shape[1],
        q.shape[1],
        q.shape[0],
        q.device,
        sliding_window,
    )
    return attend(q, k_cache, v_cache, plan, scale, softcap)


def attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    scale: float,
    softcap: float = 0.0,
) -> Tensor:
    """`paged_attention` with a prebuilt plan (the cache already holds this step's K/V);
    `softcap` > 0: scores capped as `softcap * tanh(score / softcap)` (Gemma 2)."""
    T, H, D = q.shape
    KVH, row = k_cache.shape[2:]
    k_flat = k_cache.view(-1, KVH, row)
    v_flat = v_cache.view(-1, KVH, row)
    q32 = q.float()  # no copy when q is already float32
    if plan.identity:
        o = _attend_sub(q32, k_flat, v_flat, plan.subs[0], scale, softcap)
        return o.reshape(T, H, D).to(q.dtype)
    out = torch.zeros_like(q)
    for sub in plan.subs:
        o = _attend_sub(q32, k_flat, v_flat, sub, scale, softcap).reshape(-1, H, D)
        out.index_copy_(0, sub.out_dst, o.index_select(0, sub.out_src).to(out.dtype))
    return out


def _attend_sub(
    q: Tensor, k_flat: Tensor, v_flat: Tensor, sub: _SubBatch, scale: float, softcap: float = 0.0
) -> Tensor:
    """float32 `[S, max_q, H, D]` attention of one sub-batch (rows of dead queries are
    unspecified)."""
    S, max_q, N = sub.S, sub.max_q, sub.N
    _, H, D = q.shape
    KVH, row = k_flat.shape[1:]
    # one flat gather per cache instead of table indexing + reshape + slicing
    bufs = sub.bufs
    if bufs is None or bufs[0].dtype != k_flat.dtype or bufs[0].shape[1:] != k_flat.shape[1:]:
        bufs = sub.bufs = (k_flat.new_empty(S * N, KVH, row), v_flat.new_empty(S * N, KVH, row))
    torch.index_select(k_flat, 0, sub.ctx_slots, out=bufs[0])
    torch.index_select(v_flat, 0, sub.ctx_slots, out=bufs[1])
    # a quantized cache: dequantized after the gather (only the context's rows)
    keys = dequantize_rows(bufs[0].view(S, N, KVH, row)).transpose(1, 2)
    vals = dequantize_rows(bufs[1].view(S, N, KVH, row)).transpose(1, 2)
    qp = q if sub.q_rows is None else q.index_select(0, sub.q_rows)
    if softcap > 0:
        return _capped_attention(qp.view(S, max_q, H, D), keys, vals, sub.mask, scale, softcap)
    if max_q == 1:
        # decode: the G query heads of a kv head are G queries of one MHA head (no GQA expansion)
        o = F.scaled_dot_product_attention(
            qp.view(S, KVH, H // KVH, D),
            keys,
            vals,
            attn_mask=sub.mask.view(S, 1, 1, N),
            scale=scale,
        )
        return o.reshape(S, 1, H, D)
    qp = qp.view(S, max_q, H, D).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        qp, keys, vals, attn_mask=sub.mask, scale=scale, enable_gqa=H != KVH
    )
    return o.transpose(1, 2)


def _capped_attention(
    q: Tensor, keys: Tensor, vals: Tensor, mask: Tensor, scale: float, softcap: float
) -> Tensor:
    """Attention with soft-capped scores (SDPA has no capping): q `[S, max_q, H, D]`, keys and
    values `[S, KVH, N, D]` -> `[S, max_q, H, D]`."""
    H, KVH = q.shape[2], keys.shape[1]
    keys = keys.repeat_interleave(H // KVH, dim=1)
    vals = vals.repeat_interleave(H // KVH, dim=1)
    scores = torch.matmul(q.transpose(1, 2), keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(torch.softmax(scores, dim=-1), vals).transpose(1, 2)


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    num_splits: int = 1,
) -> Tensor:
    """One query token per sequence (q `[S, H, D]`) over its whole context; seq_len 0 -> zeros.

    `num_splits` only shapes the Triton launch; the result does not depend on it.
    """
    del num_splits
    S = q.shape[0]
    qsl = torch.arange(S + 1, device=q.device, dtype=torch.long)
    return paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale)


def paged_prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int,
) -> Tensor:
    """Prefill / chunk attention over the paged cache, causal within the new tokens.

    `max_query_len` only shapes the Triton launch; the reference derives what it needs.
    """
    del max_query_len
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)


def copy_blocks(kv_cache: Tensor, block_mapping: Tensor) -> None:
    """Copy-on-write: `kv_cache[:, :, dst] = kv_cache[:, :, src]` for every (src, dst) row, all
    layers."""
    if block_mapping.numel() == 0:
        return
    bm = block_mapping.to(kv_cache.device, torch.long)
    kv_cache = as_bytes(kv_cache)
    # advanced indexing reads every source before writing (sources and destinations are disjoint)
    kv_cache[:, :, bm[:, 1]] = kv_cache[:, :, bm[:, 0]]
