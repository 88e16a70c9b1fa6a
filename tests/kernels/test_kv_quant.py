"""Quantized KV caches (int8, fp8_e4m3, fp8_e5m2): the torch definition of the formats
(`kernels.reference.quantize_rows` / `dequantize_rows`), the Rust store coding rows bit for bit as
it does, and the Rust attention kernels (decode and prefill, float32 and bfloat16 queries) against
the torch reference over the same quantized cache (the reference dequantizes, the kernels read the
codes: equal up to summation order)."""

import math

import numpy as np
import pytest
import torch

from pagedllm import _core
from pagedllm.attention.cpu_attention import _cache_view
from pagedllm.kernels import reference as ref
from pagedllm.kernels.cpu_arrays import numpy_view

FORMATS = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
ALL_FORMATS = pytest.mark.parametrize("kv_dtype", list(FORMATS))


def _rows(n, d, seed, dtype=torch.float32, magnitudes=(-3, 2)):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes (and one all zero): the scale is per row. From 10^-3 to
    # 10^2 the rotated rows' amaxes (~20x) reach below and above the scale byte's bounds
    x = torch.randn(n, d, generator=g) * torch.logspace(*magnitudes, n)[:, None]
    x[n // 2] = 0
    return x.to(dtype)


@ALL_FORMATS
def test_round_trip_is_within_half_a_step_of_the_format(kv_dtype):
    cache_dtype = FORMATS[kv_dtype]
    # rotated amaxes ~2 to ~200: within the scale byte's band (2 to 256, 5 mantissa bits)
    x = _rows(32, 64, seed=1, magnitudes=(-1, 1))
    amax = ref.hadamard(x).abs().amax(-1, keepdim=True)
    assert float(amax[amax > 0].min()) > 2 and float(amax.max()) < 256
    rows = ref.quantize_rows(x, cache_dtype)
    assert rows.dtype == cache_dtype and rows.shape == (32, 64 + ref.KV_SCALE_BYTES)
    back = ref.dequantize_rows(rows)
    # the codes are of the rotated row (H x, H H = 64 I): each value's error is at most the
    # largest of the rotated row's errors, half a step of it (its bound < 1.03125 of its amax)
    if kv_dtype == "int8":
        bound = 1.03125 * amax / 127 / 2
    else:
        # half an ulp of the largest rotated value (3 or 2 mantissa bits)
        mantissa = {"fp8_e4m3": 3, "fp8_e5m2": 2}[kv_dtype]
        bound = amax * 2.0**-mantissa / 2
    assert bool(((back - x).abs() <= bound * 1.0001 + 1e-30).all())
    assert bool((back[16] == 0).all())


def test_rotation_spreads_a_large_channel_so_int8_resolves_the_rest_finer():
    # keys after RoPE: a few channels far larger than the rest set a plain row's int8 step
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=g)
    x[:, 23] *= 12.0
    err = (ref.dequantize_rows(ref.quantize_rows(x, torch.int8)) - x).pow(2).mean().sqrt()
    plain_step = x.abs().amax(-1).mean() / 127
    # unrotated codes would err by ~step / sqrt(12); rotated, less than half that
    assert err < 0.5 * plain_step / math.sqrt(12)


def test_the_scale_byte_codes_the_smallest_bound_at_least_the_rows_amax():
    x = torch.tensor([[3.0, -1.0], [3.03, 0.0], [1.01, 0.0], [300.0, 0.0], [0.0, 0.0], [1e9, 1.0]])
    # after the 2-wide rotation the amaxes are 4, 3.03, 1.01, 300, 0, ~1e9
    byte = ref.quantize_rows(x, torch.int8).view(torch.uint8)[:, -1]
    # 5 mantissa bits from 2 to 256 (4, 3.03 -> 3.0625), 1 outside (1.01 -> 1.5, 300 -> 384);
    # out of range the smallest (2^-7) or the largest (49152)
    assert byte.tolist() == [16 + 32, 16 + 17, 15, 241, 0, 255]
    assert ref._row_scale(byte, torch.int8).mul(127).tolist() == pytest.approx(
        [4.0, 3.0625, 1.5, 384.0, 2**-7, 49152.0], rel=1e-6
    )


def test_a_row_below_the_smallest_bound_errs_by_at_most_half_its_step():
    x = _rows(8, 64, seed=4, magnitudes=(-6, -4.5))
    assert float(ref.hadamard(x).abs().amax()) < 2**-7
    back = ref.dequantize_rows(ref.quantize_rows(x, torch.int8))
    assert bool(((back - x).abs() <= 2**-7 / 127 / 2 * 1.0001).all())


def test_a_row_above_the_largest_bound_saturates_its_codes():
    x = torch.full((1, 64), 10.0)
    x[0, 0] = 60000.0  # rotated: 60630, then 59990 in every other channel: above the bound 49152
    rows = ref.quantize_rows(x, torch.int8)
    assert rows.view(torch.uint8)[0, -1] == 255
    assert bool((rows[0, :-1].abs() == 127).all())


def _store_rust(k, v, kc, vc, slots, kv_dtype):
    _core.cpu_store_kvcache(
        numpy_view(k), numpy_view(v), _cache_view(kc), _cache_view(vc), slots.numpy(), kv_dtype
    )


@ALL_FORMATS
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_rust_store_codes_rows_bit_for_bit_as_the_reference(kv_dtype, model_dtype):
    cache_dtype = FORMATS[kv_dtype]
    n, kvh, d, bs, blocks = 10, 2, 32, 4, 5
    k = _rows(n * kvh, d, seed=2, dtype=model_dtype).view(n, kvh, d)
    v = _rows(n * kvh, d, seed=3, dtype=model_dtype).view(n, kvh, d)
    slots = torch.tensor([3, 0, -1, 7, 19, 8, 9, 10, -1, 1], dtype=torch.int64)
    shape = (blocks, bs, kvh, d + ref.KV_SCALE_BYTES)
    want_k, want_v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    ref.store_kvcache(k, v, want_k, want_v, slots)
    got_k, got_v = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    _store_rust(k, v, got_k, got_v, slots, kv_dtype)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def _quantized_batch(ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, kv_dtype, dtype):
    """A batch whose whole context was stored through the Rust store (as the engine does)."""
    g = torch.Generator().manual_seed(sum(ctx_lens) + head_dim)
    nblk = [max(1, -(-n // block_size)) for n in ctx_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx_lens), max(nblk) + 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n]
        used += n
    slots = torch.cat(
        [
            tables[s, torch.arange(n) // block_size].long() * block_size
            + torch.arange(n) % block_size
            for s, n in enumerate(ctx_lens)
        ]
    )
    k = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim + ref.KV_SCALE_BYTES)
    kc = torch.zeros(shape, dtype=FORMATS[kv_dtype])
    vc = torch.zeros(shape, dtype=FORMATS[kv_dtype])
    _store_rust(k, v, kc, vc, slots, kv_dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    return q, kc, vc, tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32)


def _rust_attention(q, kc, vc, qsl, lens, tables, scale, kv_dtype, threads=1):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    _core.cpu_paged_attention(
        numpy_view(q),
        _cache_view(kc),
        _cache_view(vc),
        qsl.numpy(),
        lens.numpy(),
        tables.numpy(),
        scale,
        numpy_view(out),
        threads,
        kv_dtype,
    )
    return out


SHAPES = pytest.mark.parametrize(
    "ctx_lens,q_lens,heads,kv_heads,head_dim,block_size",
    [
        # decode, GQA 4, partial last blocks, a one-token context (keys in lanes)
        ([37, 5, 16, 1, 300], [1, 1, 1, 1, 1], 8, 2, 64, 16),
        # decode, GQA 3 (SmolLM2's): a pair of rows per key widening, then a single row
        ([45, 130], [1, 1], 9, 3, 64, 16),
        # prefill chunks over a cached prefix beside decodes (rows in lanes), head_dim 128
        ([40, 70, 17], [40, 33, 1], 4, 2, 128, 16),
        # a head size not a multiple of 8 (the portable loop), odd block size
        ([13, 29], [13, 1], 6, 3, 20, 5),
    ],
)


@SHAPES
@ALL_FORMATS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rust_attention_over_a_quantized_cache_matches_the_reference(
    ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, kv_dtype, dtype
):
    q, kc, vc, tables, qsl, lens = _quantized_batch(
        ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, kv_dtype, dtype
    )
    scale = 1 / math.sqrt(head_dim)
    want = ref.paged_attention(q.float(), kc, vc, qsl, lens, tables, scale)
    got = _rust_attention(q, kc, vc, qsl, lens, tables, scale, kv_dtype, threads=2)
    # float32: summation order only; bfloat16: plus the output's one rounding
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _store_one_row(cache_dtype, kv_dtype):
    k = torch.zeros(1, 1, 8).numpy()
    caches = [torch.zeros(1, 1, 1, 12, dtype=cache_dtype).numpy() for _ in range(2)]
    _core.cpu_store_kvcache(k, k, *caches, np.zeros(1, np.int64), kv_dtype)


def test_an_unknown_kv_cache_dtype_is_a_value_error_naming_the_accepted_ones():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int8'.*got 'int4'"):
        _store_one_row(torch.int8, "int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ref.kv_storage_dtype("int4", torch.float32)


def test_a_cache_of_the_wrong_dtype_for_the_format_is_a_type_error():
    with pytest.raises(TypeError, match=r"k_cache must be a 4-D int8"):
        _store_one_row(torch.uint8, "int8")
