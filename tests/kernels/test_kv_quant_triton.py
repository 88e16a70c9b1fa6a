"""The Triton kernels over a quantized KV cache (int8, fp8_e4m3, fp8_e5m2; under the interpreter
without a GPU): the store codes rows as `reference.quantize_rows` does, the decode and prefill
kernels read codes and row scales and match the torch reference over the same cache. And over a
bfloat16 cache under float32 queries (`kv_cache_dtype="bfloat16"`): the store rounds as torch
does. Tiny shapes: the interpreter is slow."""

import math

import pytest
import torch

from pagedllm.kernels import reference as ref
from pagedllm.kernels.decode_attention import paged_decode_attention
from pagedllm.kernels.prefill_attention import paged_prefill_attention
from pagedllm.kernels.store_kv import store_kvcache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16]
KVH, D, PAGE = 2, 16, 4


def _caches(num_blocks, cache_dtype):
    shape = (num_blocks, PAGE, KVH, ref.kv_row_size(D, cache_dtype))
    return (torch.zeros(shape, dtype=cache_dtype, device=DEV) for _ in range(2))


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_triton_store_codes_rows_bit_for_bit_as_the_reference(cache_dtype):
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(6, KVH, D, generator=g) * torch.logspace(-2, 2, 6)[:, None, None]).to(DEV)
    v = torch.randn(6, KVH, D, generator=g).to(DEV)
    k[2] = 0  # a zero row: scale 0, zero codes
    slots = torch.tensor([5, 0, 11, -1, 2, 7], device=DEV)
    want_k, want_v = _caches(3, cache_dtype)
    ref.store_kvcache(k.cpu(), v.cpu(), want_k.cpu(), want_v.cpu(), slots.cpu())
    ref.store_kvcache(k, v, want_k, want_v, slots)
    got_k, got_v = _caches(3, cache_dtype)
    store_kvcache(k, v, got_k, got_v, slots)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def _stored_context(seq_lens, cache_dtype, seed):
    """Caches holding every sequence's whole context (stored through the reference) and tables."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // PAGE) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    perm = torch.randperm(sum(nblk), generator=g)
    used = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = perm[used : used + n]
        used += n
    slots = torch.cat(
        [
            tables[s, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
            for s, n in enumerate(seq_lens)
        ]
    )
    kc, vc = _caches(sum(nblk), cache_dtype)
    k, v = (torch.randn(len(slots), KVH, D, generator=g) for _ in range(2))
    ref.store_kvcache(k.to(DEV), v.to(DEV), kc, vc, slots.to(DEV))
    return kc, vc, tables.to(DEV)


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_triton_decode_over_a_quantized_cache_matches_the_reference(cache_dtype):
    seq_lens = [9, 1, 14]
    kc, vc, tables = _stored_context(seq_lens, cache_dtype, seed=1)
    q = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(2)).to(DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(D)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, scale)
    got = paged_decode_attention(q, kc, vc, tables, lens, scale, num_splits=2, block_n=4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_triton_prefill_over_a_quantized_cache_matches_the_reference(cache_dtype):
    seq_lens, q_lens = [10, 5], [6, 5]
    kc, vc, tables = _stored_context(seq_lens, cache_dtype, seed=3)
    q = torch.randn(sum(q_lens), 4, D, generator=torch.Generator().manual_seed(4)).to(DEV)
    qsl = torch.tensor([0, 6, 11], dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(D)
    want = ref.paged_prefill_attention(q, kc, vc, qsl, lens, tables, scale, 6)
    got = paged_prefill_attention(q, kc, vc, qsl, lens, tables, scale, 6, block_m=16, block_n=4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_triton_store_codes_keys_with_feedback_bit_for_bit_as_the_reference(cache_dtype):
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(5, KVH, D, generator=g) * torch.logspace(-1, 1, 5)[:, None, None]).to(DEV)
    v = torch.randn(5, KVH, D, generator=g).to(DEV)
    # above the diagonal the pushed errors, on it the scale search's weights
    feedback = torch.triu(torch.randn(KVH, D, D, generator=g) * 0.3, diagonal=1)
    feedback = (feedback + torch.diag_embed(torch.rand(KVH, D, generator=g) + 0.5)).to(DEV)
    slots = torch.tensor([5, 0, -1, 2, 7], device=DEV)
    want_k, want_v = _caches(2, cache_dtype)
    ref.store_kvcache(k, v, want_k, want_v, slots, feedback)
    got_k, got_v = _caches(2, cache_dtype)
    store_kvcache(k, v, got_k, got_v, slots, feedback)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
