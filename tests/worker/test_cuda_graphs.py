"""The CPU-side parts of the decode CUDA graphs (`pagedllm.worker.cuda_graphs`): when graphs are
used, the batch buckets, the copy of a step into the persistent buffers with inert padding rows,
which steps replay, and the model runner's hook. Capture and replay themselves need a GPU:
tests/gpu/test_cuda_graphs_replay.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.attention.paged import AttentionMetadata
from pagedllm.worker.cuda_graphs import (
    DecodeBuffers,
    DecodeCudaGraphs,
    batch_buckets,
    bucket_for,
    decode_graphs_enabled,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def decode_meta(seq_lens, tables, slots) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        is_decode_only=True,
    )


def test_graphs_only_on_cuda_without_enforce_eager_or_lora():
    assert decode_graphs_enabled(CUDA, enforce_eager=False, lora=False)
    assert not decode_graphs_enabled(CUDA, enforce_eager=True, lora=False)
    assert not decode_graphs_enabled(CUDA, enforce_eager=False, lora=True)
    assert not decode_graphs_enabled(CPU, enforce_eager=False, lora=False)


def test_buckets_are_small_powers_of_two_then_every_16_up_to_max_num_seqs():
    assert batch_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]


def test_buckets_refuse_a_non_positive_max_num_seqs():
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


def test_a_batch_gets_the_smallest_bucket_that_holds_it():
    buckets = batch_buckets(40)
    assert [bucket_for(buckets, n) for n in (1, 3, 8, 9, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]
    assert bucket_for(buckets, 41) is None


def test_load_copies_the_step_and_pads_to_the_bucket():
    buf = DecodeBuffers(max_batch=8, max_blocks=4, device=CPU)
    meta = decode_meta([5, 9, 2], [[3, 1], [4, 6], [7, 0]], [17, 26, 29])
    buf.load(torch.tensor([11, 12, 13]), torch.tensor([4, 8, 1]), meta, batch=4)
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.positions[:4].tolist() == [4, 8, 1, 0]
    assert buf.slot_mapping[:4].tolist() == [17, 26, 29, -1]
    assert buf.seq_lens[:4].tolist() == [5, 9, 2, 0]
    assert buf.block_tables[:3, :2].tolist() == [[3, 1], [4, 6], [7, 0]]


def test_a_smaller_step_turns_the_rows_of_a_larger_one_into_padding():
    # rows left from the larger step would store K/V into slots live sequences may own now
    buf = DecodeBuffers(max_batch=8, max_blocks=2, device=CPU)
    big = decode_meta([3] * 4, [[1]] * 4, [4, 5, 6, 7])
    buf.load(torch.arange(4), torch.arange(4), big, batch=4)
    buf.load(torch.tensor([9]), torch.tensor([2]), decode_meta([3], [[1]], [6]), batch=4)
    assert buf.slot_mapping[:4].tolist() == [6, -1, -1, -1]
    assert buf.seq_lens[:4].tolist() == [3, 0, 0, 0]


def test_meta_views_the_buffers():
    buf = DecodeBuffers(max_batch=8, max_blocks=3, device=CPU)
    meta = buf.meta(4, max_seq_len=48)
    assert meta.is_decode_only and meta.max_query_len == 1
    assert meta.block_tables.shape == (4, 3) and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    buf.seq_lens[:4] = 7  # a graph captured over the meta reads what the buffers hold
    assert meta.seq_lens.tolist() == [7, 7, 7, 7]


@pytest.mark.parametrize(
    "change",
    ["prefill", "too_many_rows", "too_wide", "several_tokens_per_row"],
)
def test_only_decode_steps_the_buffers_hold_replay(change):
    buf = DecodeBuffers(max_batch=4, max_blocks=2, device=CPU)
    rows = 3
    meta = decode_meta([5] * rows, [[1, 2]] * rows, [1] * rows)
    assert buf.fits(rows, meta)
    if change == "prefill":
        meta.is_decode_only = False
    elif change == "too_many_rows":
        rows = 5
        meta = decode_meta([5] * rows, [[1, 2]] * rows, [1] * rows)
    elif change == "too_wide":
        meta = decode_meta([5] * rows, [[1, 2, 3]] * rows, [1] * rows)
    else:
        rows = 6  # 6 tokens over 3 sequences
    assert not buf.fits(rows, meta)


class RecordingGraphs:
    """Stands in for DecodeCudaGraphs: replays only steps of `accepts` rows."""

    def __init__(self, accepts: int, hidden_size: int) -> None:
        self.accepts, self.hidden_size, self.ran = accepts, hidden_size, []

    def can_run(self, input_ids, meta) -> bool:
        return input_ids.shape[0] == self.accepts

    def run(self, input_ids, positions, meta):
        self.ran.append(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], self.hidden_size)


@pytest.fixture(scope="module")
def engine():
    return LLM(device="cpu", block_size=16, max_model_len=128, num_gpu_blocks=64).llm_engine


def decode_inputs(engine, n: int, ctx: int = 20):
    page = 16
    per_seq = -(-ctx // page)
    tables = torch.arange(n * per_seq, dtype=torch.int32).view(n, per_seq)
    slots = tables[:, (ctx - 1) // page].long() * page + (ctx - 1) % page
    meta = decode_meta([ctx] * n, tables.tolist(), slots.tolist())
    ids = torch.arange(100, 100 + n)
    positions = torch.full((n,), ctx - 1)
    return ids, positions, meta, torch.arange(n)


def test_runner_replays_the_steps_the_graphs_take_and_runs_the_rest_eagerly(engine):
    runner = engine.runner
    graphs = RecordingGraphs(accepts=2, hidden_size=engine.model_config.hidden_size)
    runner.cuda_graphs = graphs
    try:
        replayed = runner.forward(decode_inputs(engine, 2))
        eager = runner.forward(decode_inputs(engine, 3))
    finally:
        runner.cuda_graphs = None
    assert graphs.ran == [2]
    # the stand-in's zero hidden states give all-zero logits; the eager forward does not
    assert replayed.abs().sum() == 0 and eager.abs().sum() > 0
    assert replayed.shape[0] == 2 and eager.shape[0] == 3


def test_padding_rows_change_nothing_in_the_real_rows(engine):
    # the graph's view of a step: the same forward over buffers padded to the bucket
    model, kv = engine.model, engine.cache_engine.kv_cache
    ids, positions, meta, _ = decode_inputs(engine, 3)
    with torch.inference_mode():
        kv.normal_()
        saved = kv.clone()
        expected = model(ids, positions, kv, meta)
        stored = kv.clone()
        kv.copy_(saved)
        buf = DecodeBuffers(max_batch=8, max_blocks=8, device=CPU)
        buf.load(ids, positions, meta, batch=8)
        padded = model(buf.input_ids[:8], buf.positions[:8], kv, buf.meta(8, 128))
    torch.testing.assert_close(padded[:3], expected)
    assert torch.equal(kv, stored), "padding rows stored K/V"


class EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay reruns the forward over the
    buffers' views and writes the captured output tensor in place, as a replay does."""

    def __init__(self, forward, output: torch.Tensor) -> None:
        self.forward, self.output = forward, output

    def replay(self) -> None:
        self.output.copy_(self.forward())


def eagerly_captured(engine, max_num_seqs: int) -> DecodeCudaGraphs:
    graphs = DecodeCudaGraphs(
        engine.model,
        engine.cache_engine.kv_cache,
        max_num_seqs=max_num_seqs,
        max_model_len=128,
        block_size=16,
    )
    buf = graphs.buffers
    for batch in graphs.buckets:
        meta = buf.meta(batch, 128)

        def forward(batch=batch, meta=meta):
            return engine.model(buf.input_ids[:batch], buf.positions[:batch], graphs.kv_cache, meta)

        graphs.outputs[batch] = forward()
        graphs.graphs[batch] = EagerGraph(forward, graphs.outputs[batch])
    return graphs


@pytest.mark.parametrize("n", [1, 3, 6])
def test_run_replays_the_bucket_and_returns_the_steps_rows(engine, n):
    graphs = eagerly_captured(engine, max_num_seqs=6)  # buckets 1, 2, 4, 6
    ids, positions, meta, _ = decode_inputs(engine, n)
    with torch.inference_mode():
        out = graphs.run(ids, positions, meta)
        expected = engine.model(ids, positions, engine.cache_engine.kv_cache, meta)
    assert out.shape[0] == n
    assert out.data_ptr() == graphs.outputs[bucket_for(graphs.buckets, n)].data_ptr()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_asks_with_its_enforce_eager_and_captures_when_told(monkeypatch, enforce_eager):
    from pagedllm.worker import cuda_graphs

    asked = []

    def enabled(device, *, enforce_eager, lora):
        asked.append((device.type, enforce_eager, lora))
        return not enforce_eager  # as on CUDA

    # the Worker asks it at capture time (imported there, so the patch is seen)
    monkeypatch.setattr(cuda_graphs, "decode_graphs_enabled", enabled)
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self: self)
    engine = LLM(
        device="cpu",
        block_size=16,
        max_model_len=128,
        num_gpu_blocks=64,
        enforce_eager=enforce_eager,
    ).llm_engine
    assert asked == [("cpu", enforce_eager, False)]
    graphs = engine.runner.cuda_graphs
    if enforce_eager:
        assert graphs is None
    else:
        assert graphs.kv_cache is engine.cache_engine.kv_cache
        assert graphs.buckets == batch_buckets(engine.args.max_num_seqs)
        assert graphs.buffers.max_blocks == 128 // 16
