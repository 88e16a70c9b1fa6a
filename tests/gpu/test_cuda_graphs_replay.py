"""Decode CUDA graphs on the device: a replay gives exactly what the eager forward gives on the
same padded inputs (hidden states and the K/V it stores), matches the unpadded eager forward,
survives a smaller batch after a larger one, and the engine's greedy tokens are those of
`enforce_eager=True`; capture reports its time and memory."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.paged import AttentionMetadata
from pagedllm.worker.cuda_graphs import batch_buckets

from model_factory import save_tiny_checkpoint

MAX_NUM_SEQS = 40  # buckets 1, 2, 4, 8, 16, 32, 40
PAGE, MAX_MODEL_LEN, NUM_BLOCKS = 16, 256, 1024  # room for 40 x 16 blocks
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def llm(request, qwen3):
    return LLM(
        str(qwen3),
        dtype=request.param,
        device="cuda",
        block_size=PAGE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        num_gpu_blocks=NUM_BLOCKS,
    )


def decode_step(n: int, seed: int):
    """A decode step of n sequences with random contexts and random blocks."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, MAX_MODEL_LEN - 1, (n,), generator=g)
    per_seq = -(-int(ctx.max()) // PAGE)
    tables = torch.randperm(NUM_BLOCKS, generator=g)[: n * per_seq].view(n, per_seq).int()
    last = ctx - 1
    slots = tables[torch.arange(n), last // PAGE].long() * PAGE + last % PAGE
    meta = AttentionMetadata(
        slot_mapping=slots.cuda(),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32).cuda(),
        seq_lens=ctx.int().cuda(),
        block_tables=tables.cuda(),
        max_query_len=1,
        max_seq_len=int(ctx.max()),
        is_decode_only=True,
    )
    return torch.randint(0, 300, (n,), generator=g).cuda(), last.cuda(), meta


@pytest.mark.parametrize("n", [1, 3, 17, MAX_NUM_SEQS])
def test_replay_equals_eager_on_the_same_padded_inputs(llm, n):
    engine = llm.llm_engine
    graphs, kv = engine.runner.cuda_graphs, engine.cache_engine.kv_cache
    ids, positions, meta = decode_step(n, seed=n)
    with torch.inference_mode():
        kv.normal_()
        before = kv.clone()
        replayed = graphs.run(ids, positions, meta).clone()
        after_replay = kv.clone()
        kv.copy_(before)
        batch = next(b for b in graphs.buckets if b >= n)
        buf = graphs.buffers
        eager = engine.model(
            buf.input_ids[:batch], buf.positions[:batch], kv, buf.meta(batch, MAX_MODEL_LEN)
        )
    assert torch.equal(replayed, eager[:n])
    assert torch.equal(kv, after_replay)


@pytest.mark.parametrize("n", [3, 33])
def test_replay_matches_the_unpadded_eager_forward(llm, n):
    engine = llm.llm_engine
    ids, positions, meta = decode_step(n, seed=100 + n)
    with torch.inference_mode():
        engine.cache_engine.kv_cache.normal_()
        replayed = engine.runner.cuda_graphs.run(ids, positions, meta).clone()
        eager = engine.model(ids, positions, engine.cache_engine.kv_cache, meta)
    tol = TOL[llm.llm_engine.args.dtype]
    torch.testing.assert_close(replayed.float(), eager.float(), atol=tol, rtol=tol)


def test_a_smaller_batch_after_a_larger_one_matches_eager(llm):
    engine = llm.llm_engine
    graphs, kv = engine.runner.cuda_graphs, engine.cache_engine.kv_cache
    tol = TOL[llm.llm_engine.args.dtype]
    with torch.inference_mode():
        kv.normal_()
        graphs.run(*decode_step(16, seed=7))  # fills rows 3..15 of bucket 16
        ids, positions, meta = decode_step(9, seed=8)  # bucket 16 again: rows 9..15 padding
        snapshot = kv.clone()
        replayed = graphs.run(ids, positions, meta).clone()
        stored = kv.clone()
        kv.copy_(snapshot)
        eager = engine.model(ids, positions, kv, meta)
    torch.testing.assert_close(replayed.float(), eager.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(stored, kv, atol=0, rtol=0)


def test_capture_reports_time_and_memory(llm):
    stats = llm.llm_engine.runner.cuda_graphs.stats()
    assert stats["buckets"] == len(batch_buckets(MAX_NUM_SEQS))
    assert stats["capture_s"] > 0 and stats["capture_MiB"] >= 0


def test_greedy_tokens_with_graphs_are_the_eager_ones(qwen3):
    prompts = [[5, 17, 99, 3], list(range(20, 41)), [7] * 9 + [11], list(range(100, 150))] * 3
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        llm = LLM(
            str(qwen3),
            dtype="float32",
            device="cuda",
            block_size=PAGE,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            num_gpu_blocks=NUM_BLOCKS,
            enforce_eager=eager,
        )
        assert (llm.llm_engine.runner.cuda_graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in outs]
    assert tokens[False] == tokens[True]
