"""Each Triton kernel against its torch reference (`pagedllm.kernels.reference`), and the
reference block copy against a plain copy.

Without a GPU these run under the Triton interpreter (TRITON_INTERPRET=1, set in conftest.py) on CPU
tensors; with one they run natively on CUDA. Shapes are tiny because the interpreter costs ~0.3 ms
per program, yet they cover several blocks per sequence, GQA, partially filled last blocks,
split-KV with several splits, chunks over a cached prefix and padding rows/slots.
"""

import math

import pytest
import torch

from pagedllm.attention.paged import AttentionMetadata, _paged_attention_triton
from pagedllm.kernels import reference as ref
from pagedllm.kernels.block_copy import copy_blocks
from pagedllm.kernels.decode_attention import choose_num_splits, paged_decode_attention
from pagedllm.kernels.prefill_attention import paged_prefill_attention
from pagedllm.kernels.store_kv import store_kvcache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (dtype, tolerance); low-precision inputs are compared with the reference run on the same values
DTYPES = [(torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)]


def _paged_cache(seq_lens, num_kv_heads, head_dim, page, dtype, seed):
    """Random caches and block tables drawn from a shuffled pool (spare blocks hold garbage too)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [max(1, -(-L // page)) for L in seq_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(nblk) + 1, dtype=torch.int32)  # + an unused column
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    return k_cache.to(DEV), v_cache.to(DEV), tables.to(DEV)


def _check(out, exp, tol):
    assert out.dtype == exp.dtype
    torch.testing.assert_close(out.float(), exp.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_store_kvcache_kernel_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(1)
    T, kvh, d, page, num_blocks = 6, 2, 32, 4, 5
    # k/v as strided views of one fused projection output, as the models produce them
    fused = torch.randn(T, 3 * kvh * d, generator=g).to(dtype).to(DEV)
    k = fused[:, kvh * d : 2 * kvh * d].view(T, kvh, d)
    v = fused[:, 2 * kvh * d :].view(T, kvh, d)
    slots = torch.tensor([3, 17, -1, 4, 0, -1], dtype=torch.int64, device=DEV)
    kc = torch.randn(num_blocks, page, kvh, d, generator=g).to(dtype).to(DEV)
    vc = torch.randn(num_blocks, page, kvh, d, generator=g).to(dtype).to(DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kvcache(k, v, kc, vc, slots)
    ref.store_kvcache(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(kc.view(-1, kvh, d)[17], k[1])


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_kernel_matches_reference(dtype, tol, num_splits):
    # GQA 2; 37 tokens = 9 full pages + 1 partial; a seq_len 0 padding row at the end
    heads, kvh, d, page = 4, 2, 32, 4
    seq_lens = [37, 5, 16, 0]
    k_cache, v_cache, tables = _paged_cache(seq_lens, kvh, d, page, dtype, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = (
        torch.randn(len(seq_lens), heads, d, generator=torch.Generator().manual_seed(3))
        .to(dtype)
        .to(DEV)
    )
    scale = 1 / math.sqrt(d)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits, block_n=16)
    exp = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    _check(out, exp, tol)
    assert torch.count_nonzero(out[3]) == 0


def test_decode_attention_kernel_matches_reference_with_gqa4_head_dim_64_many_splits():
    # more splits than 16-token tiles of the shorter sequence: its trailing splits are empty
    heads, kvh, d, page = 8, 2, 64, 8
    seq_lens = [70, 9]
    k_cache, v_cache, tables = _paged_cache(seq_lens, kvh, d, page, torch.float32, seed=4)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(2, heads, d, generator=torch.Generator().manual_seed(5)).to(DEV)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 4, block_n=16)
    _check(out, ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1), 2e-5)


def _qsl(q_lens):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return qsl.to(DEV)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_prefill_attention_kernel_matches_reference(dtype, tol):
    # full prompt spanning 2 query tiles; chunk of 7 over a 30-token cached prefix (not tile
    # aligned: exercises both the unmasked and the causal key loops); a decode row in the batch
    heads, kvh, d, page = 4, 2, 32, 4
    seq_lens, q_lens = [21, 37, 6], [21, 7, 1]
    k_cache, v_cache, tables = _paged_cache(seq_lens, kvh, d, page, dtype, seed=6)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    qsl = _qsl(q_lens)
    q = (
        torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(7))
        .to(dtype)
        .to(DEV)
    )
    scale = 1 / math.sqrt(d)
    out = paged_prefill_attention(
        q, k_cache, v_cache, qsl, lens, tables, scale, max(q_lens), block_m=16, block_n=16
    )
    _check(
        out,
        ref.paged_prefill_attention(q, k_cache, v_cache, qsl, lens, tables, scale, max(q_lens)),
        tol,
    )


def test_prefill_attention_kernel_matches_reference_with_gqa4_head_dim_128_and_padding_rows():
    # GQA 4, D=128, page 16 with a partial last page; q carries 2 padding rows past
    # query_start_loc[-1]
    heads, kvh, d, page = 4, 1, 128, 16
    seq_lens, q_lens = [40, 3], [18, 3]
    k_cache, v_cache, tables = _paged_cache(seq_lens, kvh, d, page, torch.float32, seed=8)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    qsl = _qsl(q_lens)
    q = torch.randn(sum(q_lens) + 2, heads, d, generator=torch.Generator().manual_seed(9)).to(DEV)
    out = paged_prefill_attention(
        q, k_cache, v_cache, qsl, lens, tables, 0.09, 18, block_m=16, block_n=16
    )
    _check(out, ref.paged_prefill_attention(q, k_cache, v_cache, qsl, lens, tables, 0.09, 18), 2e-5)
    assert torch.count_nonzero(out[-2:]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_kernel_matches_reference(dtype):
    kv = (
        torch.randn(2, 3, 8, 4, 2, 16, generator=torch.Generator().manual_seed(10))
        .to(dtype)
        .to(DEV)
    )
    kv_ref = kv.clone()
    mapping = torch.tensor([[1, 5], [2, 6], [0, 7]], dtype=torch.int64, device=DEV)
    copy_blocks(kv, mapping)
    ref.copy_blocks(kv_ref, mapping)
    assert torch.equal(kv, kv_ref)
    assert torch.equal(kv[:, :, 7], kv[:, :, 0])
    copy_blocks(kv, mapping[:0])  # no pairs: a no-op, no launch
    assert torch.equal(kv, kv_ref)


@pytest.mark.parametrize("decode", [False, True])
def test_triton_dispatch_stores_then_attends_like_the_reference(decode):
    """The Triton dispatch of pagedllm.attention.paged (store, then attend) against the CPU
    path."""
    heads, kvh, d, page = 4, 2, 32, 8
    seq_lens, q_lens = ([12, 30, 0], [1, 1, 1]) if decode else ([12, 30], [12, 5])
    k_cache, v_cache, tables = _paged_cache(seq_lens, kvh, d, page, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    T = sum(q_lens)
    q = torch.randn(T, heads, d, generator=g).to(DEV)
    k = torch.randn(T, kvh, d, generator=g).to(DEV)
    v = torch.randn(T, kvh, d, generator=g).to(DEV)
    slots = []
    for s, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(L - ql, L)
        slots.append(
            tables[s].cpu().long()[pos // page] * page + pos % page if L else torch.tensor([-1])
        )
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEV),
        query_start_loc=_qsl(q_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_decode_only=decode,
        num_splits=2 if decode else None,
    )
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    out = _paged_attention_triton(q, k, v, k_cache, v_cache, meta, 0.2)
    ref.store_kvcache(k, v, kc_ref, vc_ref, meta.slot_mapping)
    exp = ref.paged_attention(q, kc_ref, vc_ref, meta.query_start_loc, meta.seq_lens, tables, 0.2)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    _check(out, exp, 2e-5)


def test_reference_copy_blocks_copies_every_layer_of_each_pair():
    kv = torch.randn(2, 3, 6, 4, 2, 8)
    orig = kv.clone()
    ref.copy_blocks(kv, torch.tensor([[1, 4], [2, 5]]))
    torch.testing.assert_close(kv[:, :, 4], orig[:, :, 1])
    torch.testing.assert_close(kv[:, :, 5], orig[:, :, 2])
    torch.testing.assert_close(kv[:, :, :4], orig[:, :, :4])


def test_choose_num_splits_is_static_and_bounded():
    # depends only on batch, kv heads and the max context: short max context -> 1 split
    assert choose_num_splits(1, 8, 128) == 1
    assert choose_num_splits(1, 8, 4096) == 16
    assert choose_num_splits(256, 8, 4096) == 1  # a big batch already fills the GPU
    assert 1 <= choose_num_splits(4, 8, 2048) <= 8
