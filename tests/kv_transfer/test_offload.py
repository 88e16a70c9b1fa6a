"""The native KV offload tier (kv_offloading_size): prefixes the device cache lets go are
saved into a host pool and loaded back instead of recomputed, with outputs unchanged; a
request is admitted in the step that loads its prefix; a failed or corrupted load discards
that step and is recomputed; nothing leaks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.kv_transfer import HostKVPool
from pagedllm.kv_transfer.worker import (
    copy_slots_in,
    copy_slots_out,
    gather_blocks,
    scatter_blocks,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)
NUM_GPU_BLOCKS = 24  # 96 token slots: one conversation's history at a time


def make_llm(**kw) -> LLM:
    kw.setdefault("num_gpu_blocks", NUM_GPU_BLOCKS)
    kw.setdefault("swap_space", 0.01)
    kw.setdefault("max_model_len", 80)
    return LLM(device="cpu", block_size=4, **kw)


def histories(k: int = 4) -> list[list[int]]:
    """k distinct 48-token conversations (each evicts the one before it from the device)."""
    rng = np.random.default_rng(0)
    return [rng.integers(2, 250, size=48).tolist() for _ in range(k)]


def multi_turn(llm: LLM, params: SamplingParams) -> list[list[int]]:
    """Turn 1 of every conversation, one at a time, then turn 2 (its history plus a few new
    tokens): by then the device cache holds only the last conversation."""
    engine = llm.llm_engine
    outputs = []
    for turn in range(2):
        for i, history in enumerate(histories()):
            prompt = history + [5 + i] * (4 * turn)
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            outputs.append(out.outputs[0].token_ids)
            engine.scheduler.check_invariants()
    return outputs


def drained(llm: LLM) -> None:
    """Every transfer reported, every device block free, the pool within its size."""
    engine = llm.llm_engine
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    stats = engine.scheduler.get_stats()
    assert not engine.scheduler.has_pending_transfers()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["kv_offload_used_slots"] <= stats["kv_offload_num_slots"]
    engine.scheduler.check_invariants()


@pytest.fixture(scope="module")
def without_tier() -> dict[str, list[list[int]]]:
    llm = make_llm()
    return {"greedy": multi_turn(llm, GREEDY), "seeded": multi_turn(llm, SEEDED)}


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_outputs_are_identical_with_the_tier_on_a_workload_that_evicts_and_reloads(
    without_tier, kind
):
    llm = make_llm(kv_offloading_size=0.01)
    params = GREEDY if kind == "greedy" else SEEDED
    assert multi_turn(llm, params) == without_tier[kind]
    stats = llm.llm_engine.scheduler.get_stats()
    # turn 2 of the first three conversations loaded their 12 full blocks from the host
    assert stats["kv_offload_loaded_blocks"] >= 3 * 11
    assert stats["kv_offload_failed_blocks"] == 0
    drained(llm)


def test_outputs_are_identical_with_the_tier_under_ngram_speculation_and_chunked_prefill():
    knobs = dict(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        scheduling="chunked_prefill",
        max_num_batched_tokens=32,
    )
    want = multi_turn(make_llm(**knobs), GREEDY)
    llm = make_llm(kv_offloading_size=0.01, **knobs)
    assert multi_turn(llm, GREEDY) == want
    assert llm.llm_engine.scheduler.get_stats()["kv_offload_loaded_blocks"] > 0
    drained(llm)


def test_an_adapters_request_never_loads_the_base_models_blocks(tmp_path):
    from pagedllm.cli.export_tiny import save_random_lora_adapter
    from pagedllm.lora.request import LoRARequest

    def turns(llm: LLM) -> list[list[int]]:
        adapter = save_random_lora_adapter(tmp_path / "a", llm.llm_engine.model_config)
        lora = LoRARequest("a", 1, str(adapter))
        history = histories(1)[0]
        out = []
        for req in (None, lora):  # the base model's blocks, then the adapter's request
            llm.generate({"prompt_token_ids": history}, GREEDY, lora_request=req, use_tqdm=False)
            evict_device_cache(llm)
        for req in (lora, None):
            got = llm.generate(
                {"prompt_token_ids": history + [9]}, GREEDY, lora_request=req, use_tqdm=False
            )
            out.append((got[0].outputs[0].token_ids, got[0].metrics.num_offloaded_cached_tokens))
        return out

    want = turns(make_llm(enable_lora=True, max_lora_rank=8))
    llm = make_llm(kv_offloading_size=0.01, enable_lora=True, max_lora_rank=8)
    got = turns(llm)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    # each loaded its own 12 blocks (salted by the adapter), never the other's
    assert [offloaded for _, offloaded in got] == [48, 48]
    drained(llm)


def evict_device_cache(llm: LLM) -> None:
    """Runs two unrelated 60-token prompts: the device cache (24 blocks) keeps none of what
    it held before."""
    rng = np.random.default_rng(1)
    for _ in range(2):
        prompt = rng.integers(2, 250, size=60).tolist()
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)


def seed_tier(llm: LLM, history: list[int]) -> None:
    """`history`'s blocks saved into the tier and gone from the device cache."""
    llm.generate({"prompt_token_ids": history}, GREEDY, use_tqdm=False)
    evict_device_cache(llm)
    drained(llm)


def test_a_request_whose_prefix_is_in_the_host_tier_runs_in_the_step_that_loads_it():
    llm = make_llm(kv_offloading_size=0.01)
    engine = llm.llm_engine
    history = histories(1)[0]
    seed_tier(llm, history)
    engine.add_request("loads", {"prompt_token_ids": history + [9]}, GREEDY)
    (out,) = engine.step()
    # loaded and computed in one step: its first token is out, it never waited for the load
    assert len(out.outputs[0].token_ids) == 1
    assert engine.scheduler.request_status("loads") == "RUNNING"
    assert engine.scheduler.num_cached_tokens("loads") == 48
    assert engine.scheduler.num_external_tokens("loads") == 48
    drained(llm)


def test_engine_stats_count_the_bytes_moved_and_the_load_latencies():
    llm = make_llm(kv_offloading_size=0.01)
    history = histories(1)[0]
    seed_tier(llm, history)
    llm.generate({"prompt_token_ids": history + [9]}, GREEDY, use_tqdm=False)
    drained(llm)
    stats = llm.llm_engine.get_stats()
    pool = llm.llm_engine.kv_transfer.pool
    assert stats["kv_offload_bytes_loaded"] == 12 * pool.bytes_per_block
    assert (
        stats["kv_offload_bytes_saved"] == stats["kv_offload_saved_blocks"] * pool.bytes_per_block
    )
    assert stats["kv_offload_load_latency_count"] == 1
    assert sum(stats["kv_offload_load_latency_buckets"]) == 1
    assert stats["kv_offload_pool_bytes"] == pool.num_slots * pool.bytes_per_block


def test_a_corrupted_entry_is_never_loaded_and_its_tokens_are_recomputed():
    reference = make_llm()
    history = histories(1)[0]
    want = reference.generate({"prompt_token_ids": history + [9]}, GREEDY, use_tqdm=False)
    llm = make_llm(kv_offloading_size=0.01)
    seed_tier(llm, history)
    pool = llm.llm_engine.kv_transfer.pool
    # the slot of the 6th block no longer holds what the scheduler expects
    used = (pool.hashes != -1).nonzero().flatten()
    pool.hashes[used[5]] = 12345
    got = llm.generate({"prompt_token_ids": history + [9]}, GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats["kv_offload_failed_blocks"] >= 1
    # the blocks before the corrupted one loaded, it and the rest were computed again
    assert got[0].num_cached_tokens == 4 * 5
    assert got[0].metrics.num_offloaded_cached_tokens == 4 * 5
    drained(llm)


def test_a_failed_load_discards_its_step_and_leaves_every_output_unchanged():
    history, other = histories(2)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [other[:12], history + [9]]
    reference = make_llm()
    want = [
        out.outputs[0].token_ids
        for out in reference.generate([{"prompt_token_ids": p} for p in prompts], long)
    ]
    llm = make_llm(kv_offloading_size=0.01)
    engine = llm.llm_engine
    seed_tier(llm, history)
    engine.add_request("other", {"prompt_token_ids": prompts[0]}, long)
    engine.step()  # "other" runs
    pool = engine.kv_transfer.pool
    used = (pool.hashes != -1).nonzero().flatten()
    pool.hashes[used[3]] = 12345  # the 4th block of `history` no longer loads
    engine.add_request("loads", {"prompt_token_ids": prompts[1]}, long)
    rolled_back = engine.scheduler.get_stats()["num_rolled_back_steps"]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
    # the step that loaded it was taken back, "other"'s row with it, and computed again
    assert engine.scheduler.get_stats()["num_rolled_back_steps"] == rolled_back + 1
    assert [done["other"], done["loads"]] == want
    drained(llm)


def test_a_load_that_raises_fails_its_blocks_and_their_tokens_are_recomputed(caplog):
    history = histories(1)[0]
    want = make_llm().generate({"prompt_token_ids": history + [9]}, GREEDY, use_tqdm=False)
    llm = make_llm(kv_offloading_size=0.01)
    seed_tier(llm, history)
    connector = llm.llm_engine.kv_transfer
    load = connector._load

    def broken(*args):
        connector._load = load  # once
        raise RuntimeError("copy failed")

    connector._load = broken
    with caplog.at_level(logging.ERROR, logger="pagedllm"):
        got = llm.generate({"prompt_token_ids": history + [9]}, GREEDY, use_tqdm=False)
    assert "a KV load from the offload tier failed" in caplog.text
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    # every block of the load was dropped from the tier and computed again
    assert llm.llm_engine.scheduler.get_stats()["kv_offload_failed_blocks"] == 12
    assert got[0].metrics.num_offloaded_cached_tokens == 0
    drained(llm)


def test_nothing_leaks_after_preemptions_and_aborts_with_the_tier():
    # a cache so small that the running requests preempt each other while the tier loads
    llm = make_llm(
        kv_offloading_size=0.01, num_gpu_blocks=20, max_model_len=72, preemption_mode="recompute"
    )
    engine = llm.llm_engine
    history, *others = histories(3)
    seed_tier(llm, history)
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("loads", {"prompt_token_ids": history + [9]}, GREEDY)
    for i, other in enumerate(others):
        engine.add_request(f"o{i}", {"prompt_token_ids": other[:12]}, long)
    for _ in range(30):
        engine.step()
        engine.scheduler.check_invariants()
    assert engine.scheduler.get_stats()["num_preemptions"] > 0
    assert engine.scheduler.get_stats()["kv_offload_loaded_blocks"] > 0
    llm.llm_engine.abort_request(["o0"])
    drained(llm)


def test_a_prefix_preempted_by_recompute_is_saved_and_loaded_later_with_outputs_unchanged():
    first, second = histories(2)
    want = make_llm().generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    # 26 blocks: two 48-token prompts take 24, so their decodes soon preempt the second
    llm = make_llm(kv_offloading_size=0.01, num_gpu_blocks=26, preemption_mode="recompute")
    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": first}, long)
    engine.add_request("b", {"prompt_token_ids": second}, long)
    while not engine.requests["b"].metrics.num_preemptions:
        engine.step()
    # "b" never runs again: only its preemption can have saved its prefix
    engine.abort_request("b")
    drained(llm)
    evict_device_cache(llm)
    loaded = engine.scheduler.get_stats()["kv_offload_loaded_blocks"]
    out = llm.generate({"prompt_token_ids": second}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert engine.scheduler.get_stats()["kv_offload_loaded_blocks"] - loaded >= 11
    assert out.metrics.num_offloaded_cached_tokens >= 44
    assert out.metrics.offload_tier == "host"
    drained(llm)


def test_the_pool_allocates_exactly_the_whole_blocks_its_size_holds():
    shape = (2, 3, 4, 2, 8)  # 384 elements: 1536 bytes in float32
    pool = HostKVPool(10_000, block_shape=shape, dtype=torch.float32)
    assert pool.num_slots == 6
    assert pool.nbytes == 6 * 1536 <= 10_000
    assert pool.blocks[0].is_contiguous()
    with pytest.raises(ValueError, match="holds no KV block"):
        HostKVPool(1000, block_shape=shape, dtype=torch.float32)


def test_block_copies_round_trip_through_slots_in_the_pool_layout():
    kv = torch.randn(2, 3, 10, 4, 2, 8)
    blocks = torch.tensor([7, 2, 5])
    data = gather_blocks(kv, blocks)
    assert data.shape == (3, 2, 3, 4, 2, 8)
    pool = torch.zeros(6, 2, 3, 4, 2, 8)
    # the CUDA path's per-slot copies (pinned host memory), exercised on CPU for shapes
    copy_slots_out(pool, [4, 0, 1], data)
    back = torch.empty_like(data)
    copy_slots_in(pool, [4, 0, 1], back)
    out = torch.zeros_like(kv)
    scatter_blocks(out, torch.tensor([1, 3, 9]), back)
    assert torch.equal(out[:, :, 1], kv[:, :, 7])
    assert torch.equal(out[:, :, 3], kv[:, :, 2])
    assert torch.equal(out[:, :, 9], kv[:, :, 5])


def test_offloading_knobs_are_checked():
    with pytest.raises(ValueError, match="need kv_offloading_size"):
        EngineArgs(kv_offloading_backend="native")
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        EngineArgs(kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_size must be"):
        EngineArgs(kv_offloading_size=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(kv_offloading_size=1, enable_prefix_caching=False)
    assert EngineArgs(kv_offloading_size=1).resolved_kv_offloading_backend == "native"
    assert EngineArgs().resolved_kv_offloading_backend is None
