"""Sliding-window and soft-capped attention: the torch reference against plain dense attention,
then the Triton kernels (the interpreter without a GPU) and the Rust CPU kernel against the
reference, on tiny shapes with windows smaller than a block, a tile and the context. Block table
entries wholly before a sequence's first window are poisoned with an out-of-range block: the
kernels must never read them."""

import math

import pytest
import torch

from pagedllm.attention.paged import AttentionMetadata, LayerAttention, paged_attention
from pagedllm.kernels import reference as ref
from pagedllm.kernels.decode_attention import paged_decode_attention
from pagedllm.kernels.prefill_attention import paged_prefill_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KVH, D, PAGE = 4, 2, 16, 4


def _dense(q, k, v, q_len, scale, window=0, softcap=0.0):
    """Causal attention of the last q_len positions of one sequence over k/v `[L, KVH, D]`."""
    L = k.shape[0]
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).transpose(0, 1)
    v = v.repeat_interleave(g, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(L - q_len, L)[:, None]
    keys = torch.arange(L)[None, :]
    hidden = keys > pos
    if window:
        hidden |= keys <= pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1)


def _batch(seq_lens, q_lens, seed):
    """Random paged caches holding every sequence's whole context, the packed queries and their
    dense k/v per sequence."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // PAGE) for L in seq_lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, PAGE, KVH, D, generator=g)
    v_cache = torch.randn(num_blocks, PAGE, KVH, D, generator=g)
    dense, used = [], 0
    for s, L in enumerate(seq_lens):
        tables[s, : nblk[s]] = perm[used : used + nblk[s]]
        used += nblk[s]
        slots = (tables[s].long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:L]
        dense.append((k_cache.view(-1, KVH, D)[slots], v_cache.view(-1, KVH, D)[slots]))
    q = torch.randn(sum(q_lens), HEADS, D, generator=g)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, dense


def _poison_before_window(tables, seq_lens, q_lens, window):
    """Table entries of blocks wholly before each sequence's first query's window -> a block
    id far outside the cache (what a freed block must cost: nothing)."""
    tables = tables.clone()
    for s, (L, ql) in enumerate(zip(seq_lens, q_lens)):
        tables[s, : max(0, L - ql + 1 - window) // PAGE] = 1 << 20
    return tables


def _expected(q, dense, q_lens, scale, window, softcap=0.0):
    rows, at = [], 0
    for (k, v), ql in zip(dense, q_lens):
        rows.append(_dense(q[at : at + ql], k, v, ql, scale, window, softcap))
        at += ql
    return torch.cat(rows)


SEQ_LENS, Q_LENS = [37, 30, 9, 21], [1, 7, 9, 21]


@pytest.mark.parametrize("window", [1, 3, 8, 13, 64])
def test_reference_sliding_window_matches_dense_attention(window):
    q, kc, vc, tables, lens, qsl, dense = _batch(SEQ_LENS, Q_LENS, seed=1)
    scale = 1 / math.sqrt(D)
    tables = _poison_before_window(tables, SEQ_LENS, Q_LENS, window) % kc.shape[0]
    out = ref.paged_attention(q, kc, vc, qsl, lens, tables, scale, sliding_window=window)
    # the poisoned entries became other blocks: only correct if the reference never reads them
    torch.testing.assert_close(out, _expected(q, dense, Q_LENS, scale, window))


def test_reference_soft_capping_matches_dense_attention():
    q, kc, vc, tables, lens, qsl, dense = _batch(SEQ_LENS, Q_LENS, seed=2)
    out = ref.paged_attention(q * 4, kc, vc, qsl, lens, tables, 0.25, 5, softcap=2.0)
    torch.testing.assert_close(out, _expected(q * 4, dense, Q_LENS, 0.25, 5, softcap=2.0))


@pytest.mark.parametrize("window", [1, 6, 16, 40])
def test_triton_prefill_kernel_masks_keys_outside_the_window(window):
    q, kc, vc, tables, lens, qsl, dense = _batch(SEQ_LENS, Q_LENS, seed=3)
    scale = 1 / math.sqrt(D)
    tables = _poison_before_window(tables, SEQ_LENS, Q_LENS, window)
    out = paged_prefill_attention(
        *(t.to(DEV) for t in (q, kc, vc, qsl, lens, tables)),
        scale,
        max(Q_LENS),
        block_m=16,
        block_n=8,
        sliding_window=window,
    )
    torch.testing.assert_close(out.cpu(), _expected(q, dense, Q_LENS, scale, window))


@pytest.mark.parametrize("window,num_splits", [(1, 1), (5, 1), (11, 3), (100, 2)])
def test_triton_decode_kernel_reads_only_the_window(window, num_splits):
    seq_lens = [37, 16, 5, 50]
    q_lens = [1] * len(seq_lens)
    q, kc, vc, tables, lens, _, dense = _batch(seq_lens, q_lens, seed=4)
    scale = 1 / math.sqrt(D)
    tables = _poison_before_window(tables, seq_lens, q_lens, window)
    out = paged_decode_attention(
        *(t.to(DEV) for t in (q, kc, vc, tables, lens)),
        scale,
        num_splits,
        block_n=8,
        sliding_window=window,
    )
    torch.testing.assert_close(out.cpu(), _expected(q, dense, q_lens, scale, window))


def _meta(lens, qsl, tables):
    return AttentionMetadata(
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=tables,
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(lens.max()),
        is_decode_only=False,
    )


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (7, 0.0), (16, 0.0), (0, 1.5), (9, 1.5)])
def test_cpu_kernel_masks_the_window_and_caps_scores(window, softcap):
    # float32 on the CPU goes to the Rust kernel; nothing is stored (every slot -1)
    q, kc, vc, tables, lens, qsl, dense = _batch(SEQ_LENS, Q_LENS, seed=5)
    if window:
        tables = _poison_before_window(tables, SEQ_LENS, Q_LENS, window)
    layer = LayerAttention(0.5, window, softcap)
    k = v = torch.zeros(q.shape[0], KVH, D)
    out = paged_attention(q, k, v, kc, vc, _meta(lens, qsl, tables), layer)
    torch.testing.assert_close(out, _expected(q, dense, Q_LENS, 0.5, window, softcap))


def test_a_window_longer_than_every_context_is_full_attention():
    q, kc, vc, tables, lens, qsl, _ = _batch(SEQ_LENS, Q_LENS, seed=6)
    k = v = torch.zeros(q.shape[0], KVH, D)
    meta = _meta(lens, qsl, tables)
    full = paged_attention(q, k, v, kc, vc, meta, 0.3)
    windowed = paged_attention(q, k, v, kc, vc, meta, LayerAttention(0.3, window=4096))
    torch.testing.assert_close(windowed, full, rtol=0, atol=0)


def test_triton_kernels_cap_scores_with_and_without_a_window():
    # scores ~ |q||k| * 0.5 reach well past the cap of 2: tanh bends them
    q, kc, vc, tables, lens, qsl, dense = _batch(SEQ_LENS, Q_LENS, seed=7)
    args = (q, kc, vc, qsl, lens, tables)
    for window in (0, 9):
        out = paged_prefill_attention(
            *(t.to(DEV) for t in args),
            0.5,
            max(Q_LENS),
            block_m=16,
            block_n=8,
            sliding_window=window,
            softcap=2.0,
        )
        expected = _expected(q, dense, Q_LENS, 0.5, window, softcap=2.0)
        torch.testing.assert_close(out.cpu(), expected)
    decode_q = q[:4]
    out = paged_decode_attention(
        *(t.to(DEV) for t in (decode_q, kc, vc, tables, lens)), 0.5, 2, block_n=8, softcap=2.0
    )
    expected = _expected(decode_q, dense, [1, 1, 1, 1], 0.5, 0, softcap=2.0)
    torch.testing.assert_close(out.cpu(), expected)


def test_released_blocks_marked_minus_one_are_never_read_by_any_path():
    # hybrid KV groups: the scheduler's tables hold -1 where a window released a block
    window, scale = 6, 1 / math.sqrt(D)
    q, kc, vc, tables, lens, qsl, dense = _batch(SEQ_LENS, Q_LENS, seed=8)
    released = tables.clone()
    for s, (L, ql) in enumerate(zip(SEQ_LENS, Q_LENS)):
        released[s, : max(0, L - ql + 1 - window) // PAGE] = -1
    assert (released == -1).any()
    want = _expected(q, dense, Q_LENS, scale, window)
    k = v = torch.zeros(q.shape[0], KVH, D)
    meta = _meta(lens, qsl, released)
    cpu = paged_attention(q, k, v, kc, vc, meta, LayerAttention(scale, window))
    torch.testing.assert_close(cpu, want)
    torch_ref = ref.paged_attention(q, kc, vc, qsl, lens, released, scale, sliding_window=window)
    torch.testing.assert_close(torch_ref, want)
    prefill = paged_prefill_attention(
        *(t.to(DEV) for t in (q, kc, vc, qsl, lens, released)),
        scale,
        max(Q_LENS),
        block_m=16,
        block_n=8,
        sliding_window=window,
    )
    torch.testing.assert_close(prefill.cpu(), want)
    decode = paged_decode_attention(
        *(t.to(DEV) for t in (q[:1], kc, vc, released[:1], lens[:1])),
        scale,
        2,
        block_n=8,
        sliding_window=window,
    )
    torch.testing.assert_close(decode.cpu(), want[:1])
