"""`pagedllm.attention.paged.paged_attention` on the CPU against dense causal attention: the
Rust kernels (float32, the engine's default, and bfloat16) and the torch reference path with its
step plan (other dtypes)."""

import math

import pytest
import torch

from pagedllm.attention import paged
from pagedllm.attention.paged import AttentionMetadata, _paged_attention_torch, paged_attention
from pagedllm.kernels import reference as ref

# both CPU paths: `paged_attention` dispatches float32 to the Rust kernels
CPU_PATHS = pytest.mark.parametrize("attend", [paged_attention, _paged_attention_torch])


def _dense_attention(q, k, v, q_len, scale):
    """Plain causal attention of the last q_len positions of one sequence over unpaged k/v
    [L, KVH, D]."""
    L, kvh, _ = k.shape
    g = q.shape[1] // kvh
    k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(g, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [H, q_len, L]
    pos = torch.arange(L - q_len, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > pos, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1)  # [q_len, H, D]


def _build(
    ctx_lens, q_lens, *, num_heads, num_kv_heads, head_dim, block_size, seed=0, dtype=torch.float32
):
    """Random batch: full K/V per sequence, a shuffled paged cache holding the cached prefix of
    each."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-L // block_size) for L in ctx_lens]
    num_blocks = sum(nblk) + 3  # spare blocks stay garbage: a wrong lookup shows up
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int32)
    k_cache = (
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=dtype) * 50
    )
    v_cache = (
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=dtype) * 50
    )
    full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], []
    used = 0
    for s, (L, ql) in enumerate(zip(ctx_lens, q_lens)):
        blocks = perm[used : used + nblk[s]]
        used += nblk[s]
        tables[s, : nblk[s]] = blocks
        kf = torch.randn(L, num_kv_heads, head_dim, generator=g, dtype=dtype)
        vf = torch.randn(L, num_kv_heads, head_dim, generator=g, dtype=dtype)
        slot = blocks.long().repeat_interleave(block_size) * block_size + torch.arange(
            block_size
        ).repeat(nblk[s])
        slot = slot[:L]
        # the prefix (earlier steps / prefix-cache hits) is already in the cache
        k_cache.view(-1, num_kv_heads, head_dim)[slot[: L - ql]] = kf[: L - ql]
        v_cache.view(-1, num_kv_heads, head_dim)[slot[: L - ql]] = vf[: L - ql]
        full_k.append(kf)
        full_v.append(vf)
        qs.append(torch.randn(ql, num_heads, head_dim, generator=g, dtype=dtype))
        ks.append(kf[L - ql :])
        vs.append(vf[L - ql :])
        slots.append(slot[L - ql :])
    qsl = torch.zeros(len(ctx_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=qsl,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
        is_decode_only=all(x == 1 for x in q_lens),
    )
    return dict(
        q=torch.cat(qs),
        k=torch.cat(ks),
        v=torch.cat(vs),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        full_k=full_k,
        full_v=full_v,
    )


def _expected(b, q_lens, scale):
    outs, start = [], 0
    for kf, vf, ql in zip(b["full_k"], b["full_v"], q_lens):
        outs.append(_dense_attention(b["q"][start : start + ql], kf, vf, ql, scale))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize(
    "ctx_lens,q_lens,heads,kv_heads,head_dim,block_size",
    [
        # mixed batch: full prefill, decode, chunk over a cached prefix, single-token prompt
        ([13, 40, 29, 1], [13, 1, 7, 1], 8, 2, 32, 8),
        # decode only, GQA 4, partially filled last blocks
        ([5, 17, 33], [1, 1, 1], 4, 1, 64, 16),
        # no GQA, head_dim 128, chunk whose start is not block aligned
        ([50, 9], [21, 9], 2, 2, 128, 4),
    ],
)
@pytest.mark.parametrize("small_tiles", [False, True])
@CPU_PATHS
def test_cpu_paged_attention_matches_dense_causal_attention_and_stores_kv(
    attend, ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, small_tiles, monkeypatch
):
    if small_tiles:
        # force the CPU path's query chunking (5-row chunks) and memory-bounded sub-batches
        monkeypatch.setattr(ref, "_Q_CHUNK", 5)
        monkeypatch.setattr(ref, "_SCORE_BUDGET", 400)
    b = _build(
        ctx_lens,
        q_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    scale = 1.0 / math.sqrt(head_dim)
    out = attend(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], b["meta"], scale)
    torch.testing.assert_close(out, _expected(b, q_lens, scale), atol=1e-5, rtol=1e-5)
    # every context token, new ones included, now sits in its slot
    for s, (kf, vf) in enumerate(zip(b["full_k"], b["full_v"])):
        L = kf.shape[0]
        tbl = b["meta"].block_tables[s].long()
        pos = torch.arange(L)
        torch.testing.assert_close(b["k_cache"][tbl[pos // block_size], pos % block_size], kf)
        torch.testing.assert_close(b["v_cache"][tbl[pos // block_size], pos % block_size], vf)


@CPU_PATHS
def test_cpu_paged_attention_skips_padding_slots_and_zeroes_empty_rows(attend):
    b = _build([9, 4], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, seed=3)
    meta = b["meta"]
    # append a CUDA-graph-style padding row: seq_len 0, slot -1, table of zeros
    q = torch.cat([b["q"], torch.randn(1, 4, 32)])
    k = torch.cat([b["k"], torch.full((1, 2, 32), 7.0)])
    v = torch.cat([b["v"], torch.full((1, 2, 32), 7.0)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1])])
    meta.query_start_loc = torch.arange(4, dtype=torch.int32)
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32)])
    meta.block_tables = torch.cat(
        [meta.block_tables, torch.zeros(1, meta.block_tables.shape[1], dtype=torch.int32)]
    )
    before_k, before_v = b["k_cache"].clone(), b["v_cache"].clone()
    out = attend(q, k, v, b["k_cache"], b["v_cache"], meta, 0.2)
    torch.testing.assert_close(out[:2], _expected(b, [1, 1], 0.2), atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[2]) == 0
    # only the two real slots changed; the padding token (value 7) was written nowhere
    changed = (b["k_cache"] != before_k).any(-1).any(-1).view(-1).nonzero().view(-1)
    assert sorted(changed.tolist()) == sorted(meta.slot_mapping[:2].tolist())
    assert not (b["v_cache"] == 7.0).all(-1).any()
    assert torch.equal(
        (b["v_cache"] != before_v).any(-1).any(-1).view(-1).nonzero().view(-1), changed
    )


def test_low_precision_inputs_follow_float32_reference():
    b = _build([24, 11], [6, 1], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=5)
    q16 = b["q"].to(torch.bfloat16)
    kc, vc = b["k_cache"].to(torch.bfloat16), b["v_cache"].to(torch.bfloat16)
    out = paged_attention(
        q16, b["k"].to(torch.bfloat16), b["v"].to(torch.bfloat16), kc, vc, b["meta"], 0.125
    )
    assert out.dtype == torch.bfloat16
    # oracle: the same bf16-rounded values in float32
    exp = ref.paged_attention(
        q16.float(),
        kc.float(),
        vc.float(),
        b["meta"].query_start_loc,
        b["meta"].seq_lens,
        b["meta"].block_tables,
        0.125,
    )
    torch.testing.assert_close(out.float(), exp, atol=2e-2, rtol=2e-2)


TENSORS = ("q", "k", "v", "k_cache", "v_cache")


@pytest.mark.parametrize(
    "ctx_lens,q_lens,heads,kv_heads",
    [
        # mixed: whole prompt, decodes over several blocks, chunk over a cached prefix; GQA 4
        ([13, 40, 29, 1], [13, 1, 7, 1], 8, 2),
        # decode only over many blocks, no GQA
        ([70, 33, 129], [1, 1, 1], 4, 4),
    ],
)
def test_bf16_takes_the_rust_kernels_and_matches_the_torch_reference_path(
    ctx_lens, q_lens, heads, kv_heads, monkeypatch
):
    def build():
        b = _build(
            ctx_lens, q_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=32, block_size=8
        )
        return [b[key].bfloat16() for key in TENSORS] + [b["meta"]]

    rust, torch_path = build(), build()
    want = _paged_attention_torch(*torch_path, 0.2)

    def no_fallback(*args):
        raise AssertionError("bfloat16 on the CPU fell back to the torch reference")

    monkeypatch.setattr(paged, "_paged_attention_torch", no_fallback)
    out = paged_attention(*rust, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want)
    # the new K/V stored bit for bit, as the torch path stores them (k_cache, v_cache)
    assert torch.equal(rust[3], torch_path[3]) and torch.equal(rust[4], torch_path[4])


def test_float16_takes_the_torch_reference_path(monkeypatch):
    b = _build([9, 4], [3, 1], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
    q, k, v, kc, vc = (b[key].half() for key in TENSORS)
    calls = []
    fallback = paged._paged_attention_torch
    monkeypatch.setattr(paged, "_paged_attention_torch", lambda *a: calls.append(1) or fallback(*a))
    out = paged_attention(q, k, v, kc, vc, b["meta"], 0.2)
    assert calls == [1] and out.dtype == torch.float16


def test_step_plan_is_built_once_and_reused_by_every_layer(monkeypatch):
    # two "layers" (own caches and K/V) share one metadata object, hence one plan and its buffers
    ctx, ql = [13, 40, 29], [13, 1, 7]
    layers = [
        _build(ctx, ql, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=s)
        for s in (1, 1)
    ]
    g = torch.Generator().manual_seed(9)
    for b in layers[1:]:  # same tables and slots, different values
        for key in ("q", "k", "v", "k_cache", "v_cache"):
            b[key] = torch.randn(b[key].shape, generator=g)
    calls = []
    build = ref.build_plan
    monkeypatch.setattr(ref, "build_plan", lambda *a, **kw: calls.append(1) or build(*a, **kw))
    meta = layers[0]["meta"]
    for b in layers:
        expected = ref.paged_attention(
            b["q"], *_stored(b, meta), meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2
        )
        out = _paged_attention_torch(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], meta, 0.2)
        torch.testing.assert_close(out, expected)
    assert len(calls) == 3  # one per reference call above, one for the shared step plan
    # reassigning a field (a new step reusing the object) rebuilds the plan
    meta.seq_lens = meta.seq_lens.clone()
    _paged_attention_torch(
        layers[0]["q"],
        layers[0]["k"],
        layers[0]["v"],
        layers[0]["k_cache"],
        layers[0]["v_cache"],
        meta,
        0.2,
    )
    assert len(calls) == 4


def _stored(b, meta):
    """Copies of b's caches with its new K/V stored (what paged_attention attends over)."""
    kc, vc = b["k_cache"].clone(), b["v_cache"].clone()
    ref.store_kvcache(b["k"], b["v"], kc, vc, meta.slot_mapping)
    return kc, vc


def test_decode_only_batch_takes_the_dense_fast_path():
    # every row one query and a non-empty context: no query gather, no scatter, output used as is
    ctx = [5, 17, 33, 64]
    b = _build(ctx, [1] * 4, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, seed=4)
    meta = b["meta"]
    plan = ref.build_plan(
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.slot_mapping,
        16,
        8,
        4,
        torch.device("cpu"),
    )
    assert plan.identity and plan.store_rows is None and plan.subs[0].q_rows is None
    out = _paged_attention_torch(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], meta, 0.25)
    torch.testing.assert_close(out, _expected(b, [1] * 4, 0.25), atol=1e-5, rtol=1e-5)


def test_long_prompt_with_decodes_is_split_into_bounded_sorted_sub_batches(monkeypatch):
    # budget for ~2 chunks per sub-batch: chunks are grouped by context length, each padded to
    # its own
    monkeypatch.setattr(ref, "_Q_CHUNK", 4)
    monkeypatch.setattr(ref, "_SCORE_BUDGET", 4 * 40 * 4 * 2)
    ctx, ql = [40, 9, 30, 12], [16, 1, 1, 12]
    b = _build(ctx, ql, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=6)
    meta = b["meta"]
    plan = ref.build_plan(
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.slot_mapping,
        4,
        4,
        sum(ql),
        torch.device("cpu"),
    )
    prefill = [sub for sub in plan.subs if sub.max_q > 1]
    assert len(prefill) > 2 and [sub.N for sub in prefill] == sorted(sub.N for sub in prefill)
    assert all(sub.S * sub.max_q * sub.N * 4 <= ref._SCORE_BUDGET for sub in prefill)
    out = _paged_attention_torch(b["q"], b["k"], b["v"], b["k_cache"], b["v_cache"], meta, 0.3)
    torch.testing.assert_close(out, _expected(b, ql, 0.3), atol=1e-5, rtol=1e-5)
