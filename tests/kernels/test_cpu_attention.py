"""The Rust CPU kernels (`_core.cpu_store_kvcache`, `_core.cpu_paged_attention`) against the torch
reference (`pagedllm.kernels.reference`), like the Triton kernels in test_kernels.py: GQA, several
query tokens per sequence over a cached prefix, odd block sizes, ragged lengths, threads; in
float32 and in bfloat16 (crossing as its uint16 bits, `kernels.cpu_arrays.numpy_view`)."""

import math

import numpy as np
import pytest
import torch

from pagedllm import _core
from pagedllm.kernels import reference as ref
from pagedllm.kernels.cpu_arrays import numpy_view

SHAPES = pytest.mark.parametrize(
    "ctx_lens,q_lens,heads,kv_heads,head_dim,block_size",
    [
        # decode, GQA 4, partially filled last blocks, a one-token context
        ([37, 5, 16, 1], [1, 1, 1, 1], 8, 2, 64, 16),
        # prefill, chunks over a cached prefix, a decode, odd block size and head size
        ([13, 40, 29, 1, 70], [13, 1, 7, 1, 33], 6, 3, 24, 5),
        # no GQA, head_dim 128, chunk start not block aligned, block size 1
        ([50, 9], [21, 9], 2, 2, 128, 1),
        # speculative-verification shape: a few query tokens each over long contexts
        ([300, 257, 129], [4, 5, 3], 4, 1, 32, 16),
        # the offline workload's step (56M Llama): prompts across 16-query and 64-key tiles (the
        # register-blocked prefill tiles), a chunk starting mid-block, decodes beside them
        ([256, 100, 17, 300, 65], [256, 37, 17, 1, 1], 8, 4, 64, 16),
    ],
)


def _batch(ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-L // block_size)) for L in ctx_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx_lens), max(nblk) + 1, dtype=torch.int32)  # + an unused column
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    return q, k_cache, v_cache, tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32)


def _rust(q, k_cache, v_cache, qsl, lens, tables, scale, threads=1):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    _core.cpu_paged_attention(
        numpy_view(q),
        numpy_view(k_cache),
        numpy_view(v_cache),
        qsl.numpy(),
        lens.numpy(),
        tables.numpy(),
        scale,
        numpy_view(out),
        threads,
    )
    return out


@SHAPES
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_paged_attention_matches_reference(
    ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, threads
):
    q, kc, vc, tables, qsl, lens = _batch(
        ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, seed=sum(ctx_lens)
    )
    scale = 1 / math.sqrt(head_dim)
    exp = ref.paged_attention(q, kc, vc, qsl, lens, tables, scale)
    out = _rust(q, kc, vc, qsl, lens, tables, scale, threads)
    torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)


@SHAPES
@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_cpu_paged_attention_matches_reference_within_one_bf16_rounding(
    ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, threads
):
    q, kc, vc, tables, qsl, lens = _batch(
        ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, seed=sum(ctx_lens)
    )
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    scale = 1 / math.sqrt(head_dim)
    out = _rust(q, kc, vc, qsl, lens, tables, scale, threads)
    assert out.dtype == torch.bfloat16
    # the kernel sums in float32 over the bf16 values and rounds once: the float32 reference on
    # the same values, rounded, is within half a bf16 ulp (2^-9 relative)
    exact = ref.paged_attention(q.float(), kc.float(), vc.float(), qsl, lens, tables, scale)
    torch.testing.assert_close(out.float(), exact, atol=1e-5, rtol=2**-8)
    # and the torch reference run in bfloat16 itself agrees within bf16 tolerance
    in_bf16 = ref.paged_attention(q, kc, vc, qsl, lens, tables, scale)
    torch.testing.assert_close(out, in_bf16)


def test_bf16_cpu_store_kvcache_copies_the_bits_of_strided_rows():
    g = torch.Generator().manual_seed(4)
    T, kvh, d, page, num_blocks = 5, 2, 8, 3, 4
    fused = torch.randn(T, 3 * kvh * d, generator=g).bfloat16()
    k = fused[:, kvh * d : 2 * kvh * d].view(T, kvh, d)
    v = fused[:, 2 * kvh * d :].view(T, kvh, d)
    slots = torch.tensor([3, 11, -1, 4, 0])
    kc = torch.randn(num_blocks, page, kvh, d, generator=g).bfloat16()
    vc = torch.randn(num_blocks, page, kvh, d, generator=g).bfloat16()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    views = (numpy_view(t) for t in (k, v, kc, vc))
    _core.cpu_store_kvcache(*views, slots.numpy())
    ref.store_kvcache(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_cpu_kernels_refuse_a_call_mixing_float32_and_bf16_with_a_type_error():
    q, kc, vc, tables, qsl, lens = _batch([9], [1], 2, 1, 8, 4, seed=3)
    with pytest.raises(TypeError, match=r"k_cache must be a 4-D uint16 \(bfloat16 bits\) array"):
        _rust(q.bfloat16(), kc, vc.bfloat16(), qsl, lens, tables, 0.5)
    with pytest.raises(TypeError, match="q has dtype float64"):
        _rust(q.double(), kc.double(), vc.double(), qsl, lens, tables, 0.5)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(TypeError, match=r"v_cache must be a 4-D float32 array"):
        _core.cpu_store_kvcache(
            k.numpy(), k.numpy(), kc.numpy(), numpy_view(vc.bfloat16()), np.array([0], np.int64)
        )


def test_cpu_paged_attention_reads_strided_queries_and_zeroes_rows_past_the_sequences():
    q, kc, vc, tables, qsl, lens = _batch([20, 8], [3, 2], 4, 2, 16, 4, seed=1)
    # q as a view of a wider fused tensor (the model's q heads next to its k heads), + 2 pad rows
    wide = torch.randn(7, 6, 16)
    wide[:5, :4] = q
    exp = ref.paged_attention(wide[:, :4], kc, vc, qsl, lens, tables, 0.3)
    out = _rust(wide[:, :4], kc, vc, qsl, lens, tables, 0.3)
    torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[5:]) == 0


def test_cpu_store_kvcache_matches_reference_and_skips_padding():
    g = torch.Generator().manual_seed(2)
    T, kvh, d, page, num_blocks = 6, 2, 8, 3, 5
    fused = torch.randn(T, 3 * kvh * d, generator=g)
    k = fused[:, kvh * d : 2 * kvh * d].view(T, kvh, d)  # strided views, as the model makes them
    v = fused[:, 2 * kvh * d :].view(T, kvh, d)
    slots = torch.tensor([3, 14, -1, 4, 0, -1])
    kc, vc = torch.randn(num_blocks, page, kvh, d), torch.randn(num_blocks, page, kvh, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    _core.cpu_store_kvcache(k.numpy(), v.numpy(), kc.numpy(), vc.numpy(), slots.numpy())
    ref.store_kvcache(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_cpu_kernels_refuse_bad_slots_and_block_tables_with_value_errors():
    q, kc, vc, tables, qsl, lens = _batch([9], [1], 2, 1, 8, 4, seed=3)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 20 is outside \[-1, 20\)"):
        _core.cpu_store_kvcache(
            k.numpy(), k.numpy(), kc.numpy(), vc.numpy(), np.array([20], dtype=np.int64)
        )
    tables[0, 1] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\]"):
        _rust(q, kc, vc, qsl, lens, tables, 0.5)
    with pytest.raises(ValueError, match="needs 3 blocks"):
        _rust(q, kc, vc, qsl, lens, tables[:, :2].contiguous(), 0.5)


def test_cpu_store_kvcache_names_a_strided_slot_mapping():
    k = torch.zeros(2, 1, 8)
    kc = torch.zeros(2, 4, 1, 8)
    slots = torch.tensor([0, 9, 1, 9])[::2]
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous 1-D array"):
        _core.cpu_store_kvcache(k.numpy(), k.numpy(), kc.numpy(), kc.clone().numpy(), slots.numpy())
