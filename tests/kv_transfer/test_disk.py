"""The disk KV tier (kv_offloading_backend="disk"): block files survive a restart, engines
sharing a directory load each other's prefixes, mismatched or truncated files are never
loaded (warned, recomputed), the directory stays within its size, nothing is left behind."""

from __future__ import annotations

import logging

import pytest
from kv_transfer_util import (
    GREEDY,
    GatedLoads,
    block_files,
    generate,
    make_disk_llm,
    make_plain_llm,
    prompt,
)

from pagedllm import LLM, SamplingParams
from pagedllm._core import hash_block_chain, kv_block_file_name
from pagedllm.config import EngineArgs

make_llm = make_disk_llm


@pytest.fixture(scope="module")
def reference():
    return generate(make_plain_llm(), prompt() + [9])


def test_prefixes_survive_a_restart(tmp_path, reference):
    first = make_llm(tmp_path)
    generate(first, prompt())
    first.llm_engine.shutdown()
    # the 53 computed tokens (prompt and output but the last): 13 full blocks
    assert len(block_files(tmp_path)) == 13
    second = make_llm(tmp_path)
    out = generate(second, prompt() + [9])
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert out.metrics.num_offloaded_cached_tokens == 48
    assert out.metrics.offload_tier == "disk"
    # no temporary file is left behind
    assert all(p.suffix == ".kvblock" for p in tmp_path.iterdir())


def test_two_engines_sharing_a_directory_load_each_others_prefixes(tmp_path, reference):
    a, b = make_llm(tmp_path), make_llm(tmp_path)
    generate(a, prompt())
    out = generate(b, prompt() + [9])
    assert out.metrics.num_offloaded_cached_tokens == 48
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


@pytest.mark.parametrize("damage", ["truncated", "other_model"])
def test_a_damaged_block_file_is_ignored_with_a_warning_and_recomputed(
    tmp_path, reference, caplog, damage
):
    generate(make_llm(tmp_path), prompt())
    # the file of the prompt's sixth block
    victim = tmp_path / kv_block_file_name(hash_block_chain(prompt(), 4)[5])
    raw = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(raw[:-10])
    else:
        victim.write_bytes(raw.replace(b"pagedllm/tiny-random", b"someone/else/model__", 1))
    llm = make_llm(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        out = generate(llm, prompt() + [9])
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert "KV disk tier: ignoring" in caplog.text
    assert str(victim) in caplog.text
    stats = llm.llm_engine.get_stats()
    assert stats["kv_offload_failed_blocks"] == 1
    # the five blocks before it loaded; it and those after it were computed again
    assert out.num_cached_tokens == 5 * 4


def test_nothing_is_left_behind_after_an_abort_mid_load(tmp_path):
    generate(make_llm(tmp_path), prompt())
    files = block_files(tmp_path)
    llm = make_llm(tmp_path)  # a restart: the prefix is on disk only
    engine = llm.llm_engine
    gate = GatedLoads(llm)
    engine.add_request("loads", {"prompt_token_ids": prompt() + [9]}, GREEDY)
    engine.step()
    assert engine.scheduler.request_status("loads") == "WAITING_FOR_REMOTE_KVS"
    engine.abort_request("loads")
    engine.step()
    gate.release()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    stats = engine.scheduler.get_stats()
    assert not engine.scheduler.has_pending_transfers()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    # the files are those the first engine wrote, and no temporary file is left
    assert block_files(tmp_path) == files
    assert all(p.suffix == ".kvblock" for p in tmp_path.iterdir())
    engine.scheduler.check_invariants()


def test_the_directory_keeps_within_its_size(tmp_path):
    one = make_llm(tmp_path).llm_engine.kv_transfer
    block_file = one.file_bytes(0)
    llm = make_llm(tmp_path, kv_offloading_size=20 * block_file / 2**30)
    for seed in range(3):
        generate(llm, prompt(seed))  # 12 blocks each
    sizes = sum(p.stat().st_size for p in block_files(tmp_path))
    assert sizes <= 20 * block_file + 64
    assert len(block_files(tmp_path)) >= 12


def test_disk_knobs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_path"):
        EngineArgs(kv_offloading_size=1, kv_offloading_backend="disk")
    with pytest.raises(ValueError, match="kv_offloading_path"):
        EngineArgs(kv_offloading_size=1, kv_offloading_path=str(tmp_path))
    with pytest.raises(ValueError, match="need kv_offloading_size"):
        EngineArgs(kv_offloading_backend="disk", kv_offloading_path=str(tmp_path))


def test_a_request_waits_for_its_load_without_blocking_others(tmp_path):
    generate(make_llm(tmp_path), prompt())
    llm = make_llm(tmp_path)  # a restart: the prefix is on disk only
    engine = llm.llm_engine
    gate = GatedLoads(llm)
    engine.add_request("loads", {"prompt_token_ids": prompt() + [9]}, GREEDY)
    engine.add_request("other", {"prompt_token_ids": prompt(1, 8)}, GREEDY)
    done = {}
    for _ in range(8):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "other" in done
    assert engine.scheduler.request_status("loads") == "WAITING_FOR_REMOTE_KVS"
    gate.release()
    for _ in range(200):
        if "loads" in done:
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["loads"].num_cached_tokens == 48
    # all of them loaded from the tier, none found on the device
    assert done["loads"].metrics.num_offloaded_cached_tokens == 48


def test_a_request_preempted_then_reloading_from_disk_leaks_nothing_and_keeps_its_output(
    tmp_path,
):
    # 28 device blocks: "loads" (13 blocks to start, 18 at the end) and two others growing to
    # 13 each do not fit together, and "loads", arriving last, is the first victim
    kw = dict(num_gpu_blocks=28, max_model_len=72, preemption_mode="recompute")
    short = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [("o0", prompt(1, 12), long), ("o1", prompt(2, 12), long)]
    requests.append(("loads", prompt() + [9], short))
    base = LLM(device="cpu", block_size=4, swap_space=0.01, **kw)
    for rid, tokens, params in requests:
        base.llm_engine.add_request(rid, {"prompt_token_ids": tokens}, params)
    want = {}
    while base.llm_engine.has_unfinished_requests():
        for out in base.llm_engine.step():
            if out.finished:
                want[out.request_id] = out.outputs[0].token_ids
    generate(make_llm(tmp_path), prompt())
    llm = make_llm(tmp_path, **kw)  # a restart: the prefix is on disk only
    engine = llm.llm_engine
    status = engine.scheduler.request_status
    done = {}

    def step():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()

    first_load = GatedLoads(llm)
    for rid, tokens, params in requests:
        engine.add_request(rid, {"prompt_token_ids": tokens}, params)
    step()
    assert status("loads") == "WAITING_FOR_REMOTE_KVS"
    first_load.release()
    while status("loads") != "PREEMPTED":
        step()
    # its computed blocks went to disk when it was preempted; its reload is held
    reload = GatedLoads(llm)
    while status("loads") != "WAITING_FOR_REMOTE_KVS":
        step()
    for _ in range(4):
        step()
    assert status("loads") == "WAITING_FOR_REMOTE_KVS"
    reload.release()
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        step()
    assert done["loads"].metrics.num_preemptions > 0
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == want
    stats = engine.scheduler.get_stats()
    assert not engine.scheduler.has_pending_transfers()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    # only whole block files, and they load: a new engine serves the prefix from them
    assert all(p.suffix == ".kvblock" for p in tmp_path.iterdir())
    again = generate(make_llm(tmp_path, **kw), prompt() + [9])
    assert again.metrics.num_offloaded_cached_tokens == 48
