"""A float32 model's bfloat16 KV cache (`kv_cache_dtype="bfloat16"`): the Rust store rounds each
value to bfloat16 as torch does, and the Rust attention kernels (decode and prefill) read the
bfloat16 rows under float32 queries as the torch reference reads the same cache (equal up to
summation order). The Triton kernels over such a cache: `test_kv_quant_triton.py`."""

import math

import numpy as np
import pytest
import torch

from pagedllm import _core
from pagedllm.attention.cpu_attention import supports
from pagedllm.kernels import reference as ref
from pagedllm.kernels.cpu_arrays import numpy_view


def _store(k, v, k_cache, v_cache, slots):
    _core.cpu_store_kvcache(
        numpy_view(k), numpy_view(v), numpy_view(k_cache), numpy_view(v_cache), slots.numpy()
    )


def test_rust_store_rounds_float32_rows_into_a_bfloat16_cache_as_torch_does():
    g = torch.Generator().manual_seed(0)
    # magnitudes from 1e-30 to 1e30, and values halfway between two bfloat16s (ties to even)
    k = torch.randn(6, 2, 32, generator=g) * torch.logspace(-30, 30, 6)[:, None, None]
    k[0, 0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-133])
    v = torch.randn(6, 2, 32, generator=g)
    slots = torch.tensor([5, 0, -1, 11, 2, 7])
    got_k, got_v = (torch.zeros(3, 4, 2, 32, dtype=torch.bfloat16) for _ in range(2))
    _store(k, v, got_k, got_v, slots)
    want_k, want_v = (torch.zeros(3, 4, 2, 32, dtype=torch.bfloat16) for _ in range(2))
    ref.store_kvcache(k, v, want_k, want_v, slots)
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))
    assert got_k.flatten(0, 1)[5, 0, :3].tolist() == [1.0, 1 + 4 * 2**-8, -1.0]


@pytest.mark.parametrize(
    "ctx_lens,q_lens,heads,kv_heads,head_dim,block_size",
    [
        ([37, 5, 16, 1, 300], [1, 1, 1, 1, 1], 8, 2, 64, 16),  # decode, GQA 4, partial blocks
        ([45, 130], [1, 1], 9, 3, 64, 16),  # decode, GQA 3 (SmolLM2's)
        ([40, 70, 17], [40, 33, 1], 4, 2, 128, 16),  # prefill chunks beside a decode
        ([13, 29], [13, 1], 6, 3, 20, 5),  # a head size not a multiple of 8, odd block size
    ],
)
def test_rust_attention_of_float32_queries_over_a_bfloat16_cache_matches_the_reference(
    ctx_lens, q_lens, heads, kv_heads, head_dim, block_size
):
    g = torch.Generator().manual_seed(sum(ctx_lens) + head_dim)
    blocks = [-(-n // block_size) for n in ctx_lens]
    tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    perm = torch.randperm(sum(blocks) + 2, generator=g)
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[sum(blocks[:s]) : sum(blocks[: s + 1])]
    slots = torch.cat(
        [
            tables[s, torch.arange(n) // block_size].long() * block_size
            + torch.arange(n) % block_size
            for s, n in enumerate(ctx_lens)
        ]
    )
    shape = (sum(blocks) + 2, block_size, kv_heads, head_dim)
    kc, vc = (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(len(slots), kv_heads, head_dim, generator=g) for _ in range(2))
    _store(k, v, kc, vc, slots)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    assert supports(q, kc)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full(q.shape, float("nan"))
    args = (qsl.numpy(), lens.numpy(), tables.numpy(), scale, numpy_view(out), 2, "auto")
    _core.cpu_paged_attention(numpy_view(q), numpy_view(kc), numpy_view(vc), *args)
    want = ref.paged_attention(q, kc, vc, qsl, lens, tables, scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
