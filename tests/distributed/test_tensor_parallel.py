"""Tensor parallelism on CPU (gloo, the `mp` executor, 2 ranks): the same tokens and logits as one
rank, the knobs refused up front, and a worker that dies or hangs failing the engine loudly."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import SCHEDULING_STRATEGIES, EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.executor.base import UniprocExecutor
from pagedllm.executor.multiproc import EngineDeadError
from pagedllm.structured_output.params import StructuredOutputsParams

from engine_util import engine_greedy, greedy_tokens, running_engine
from model_factory import save_tiny_checkpoint

# prompts sharing a 32-token prefix (two full blocks: prefix-cache hits), longer than the
# token budget (chunked prefill), more than the cache holds at once (preemption)
PREFIX = list(range(40, 72))
PROMPTS = [PREFIX + [100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)]
KNOBS = dict(
    device="cpu",
    cpu_threads=1,
    max_model_len=96,
    num_gpu_blocks=14,
    max_num_batched_tokens=24,
    swap_space=0.01,
    enable_prefix_caching=True,
)


def _checkpoint(tmp_path_factory, family: str, kv_heads: int):
    folder = tmp_path_factory.mktemp(f"{family}_kv{kv_heads}")
    return save_tiny_checkpoint(folder, family, num_key_value_heads=kv_heads, seed=3)


def _run(folder, tp: int, **knobs) -> tuple[list[list[int]], dict]:
    args = EngineArgs(model=str(folder), tensor_parallel_size=tp, **KNOBS, **knobs)
    with running_engine(args) as engine:
        return greedy_tokens(engine, PROMPTS, 40), engine.get_stats()


@pytest.mark.parametrize(
    ("family", "kv_heads", "preemption_mode"),
    [("llama", 2, "recompute"), ("qwen2", 1, "swap"), ("qwen3", 2, "swap")],
)
def test_two_ranks_generate_the_greedy_tokens_of_one(
    tmp_path_factory, family, kv_heads, preemption_mode
):
    # qwen2 with one KV head: both ranks hold a replica of it
    folder = _checkpoint(tmp_path_factory, family, kv_heads)
    one, _ = _run(folder, 1, preemption_mode=preemption_mode)
    two, stats = _run(folder, 2, preemption_mode=preemption_mode)
    assert two == one
    # the run did go through the paths the ranks must mirror
    assert stats["prefix_cache_hits"] > 0
    assert stats[f"num_preemptions_{preemption_mode}"] > 0


def test_two_ranks_give_the_logits_of_one(tmp_path_factory):
    folder = _checkpoint(tmp_path_factory, "llama", 2)
    logits = {}
    for tp in (1, 2):
        engine = LLMEngine(EngineArgs(model=str(folder), tensor_parallel_size=tp, **KNOBS))
        try:
            forward = engine.runner.forward
            seen = []
            engine.runner.forward = lambda inputs, *a, _f=forward, _s=seen: (
                _s.append(_f(inputs, *a)) or _s[-1]
            )
            engine.add_request("a", {"prompt_token_ids": PROMPTS[0][:20]}, SamplingParams())
            engine.step()
            logits[tp] = seen[0]
        finally:
            engine.shutdown()
    assert logits[2].shape == logits[1].shape == (1, 320)
    torch.testing.assert_close(logits[2], logits[1], atol=1e-5, rtol=0)


def test_one_rank_never_initialises_torch_distributed(tmp_path_factory):
    folder = _checkpoint(tmp_path_factory, "llama", 2)
    engine = LLMEngine(EngineArgs(model=str(folder), **KNOBS))
    assert isinstance(engine.executor, UniprocExecutor)  # nothing to carry to other ranks
    assert not torch.distributed.is_initialized()


def _worker_pid(llm: LLM) -> int:
    (proc,) = llm.llm_engine.executor.procs
    return proc.pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _started(folder, timeout: float) -> LLM:
    llm = LLM(str(folder), tensor_parallel_size=2, tp_step_timeout=timeout, **KNOBS)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=30))
    engine.step()
    return llm


def test_a_killed_worker_fails_the_step_naming_its_rank(tmp_path_factory):
    llm = _started(_checkpoint(tmp_path_factory, "llama", 2), timeout=20.0)
    pid = _worker_pid(llm)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
    assert time.monotonic() - start < 20.0
    # dead for good: the next step says so at once, and no worker is left
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.llm_engine.step()
    assert _gone(pid)
    assert not torch.distributed.is_initialized()


def test_a_hung_worker_fails_the_step_within_the_timeout(tmp_path_factory):
    timeout = 2.0
    llm = _started(_checkpoint(tmp_path_factory, "qwen2", 1), timeout=timeout)
    pid = _worker_pid(llm)
    os.kill(pid, signal.SIGSTOP)  # alive, never answers
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.llm_engine.step()
    # one bound: rank 0's collective gives up after tp_step_timeout, and the answer is not then
    # awaited for as long again
    assert time.monotonic() - start < timeout + 1.5
    llm.llm_engine.shutdown()
    assert _gone(pid)


def test_dropping_the_llm_stops_its_workers(tmp_path_factory):
    llm = _started(_checkpoint(tmp_path_factory, "llama", 2), timeout=20.0)
    pid = _worker_pid(llm)
    del llm
    gc.collect()
    assert _gone(pid)
    assert not torch.distributed.is_initialized()


def _generate(folder, tp: int, prompts, params) -> list:
    llm = LLM(str(folder), tensor_parallel_size=tp, **KNOBS)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_a_json_schema_request_under_two_ranks_matches_one(tmp_path_factory):
    # the grammar's bitmask applies to rank 0's gathered logits: the workers never see it
    folder = _checkpoint(tmp_path_factory, "qwen3", 2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema)
    )
    one, two = (_generate(folder, tp, ["hello world"], params) for tp in (1, 2))
    assert two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert two[0].outputs[0].text.startswith("{")


def test_prompt_logprobs_under_two_ranks_match_one(tmp_path_factory):
    # the prompt rows' logits are gathered from both ranks, in slices, like the sampled rows
    folder = _checkpoint(tmp_path_factory, "llama", 2)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    prompts = [{"prompt_token_ids": PROMPTS[1]}]
    one, two = (_generate(folder, tp, prompts, params) for tp in (1, 2))
    for mine, theirs in zip(two[0].prompt_logprobs[1:], one[0].prompt_logprobs[1:], strict=True):
        assert mine.keys() == theirs.keys()
        for token, logprob in mine.items():
            assert logprob.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_a_worker_dead_before_joining_fails_the_start_at_once(tmp_path_factory):
    folder = _checkpoint(tmp_path_factory, "llama", 2)
    stop = threading.Event()

    def kill_the_first_worker() -> None:
        while not stop.is_set():
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_first_worker)
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match="rank 1 .* died"):
            LLM(str(folder), tensor_parallel_size=2, tp_step_timeout=60.0, **KNOBS)
    finally:
        stop.set()
        killer.join()
    # long before the rendezvous' timeout
    assert time.monotonic() - start < 10.0
    assert not torch.distributed.is_initialized()


def test_a_step_timeout_shorter_than_the_start_up_does_not_fail_the_start(tmp_path_factory):
    # spawning a worker and importing torch alone takes longer than this step timeout
    llm = LLM(
        str(_checkpoint(tmp_path_factory, "llama", 2)),
        tensor_parallel_size=2,
        tp_step_timeout=0.2,
        **KNOBS,
    )
    llm.llm_engine.shutdown()
    assert not torch.distributed.is_initialized()


def _engine_in_a_process(folder: str, out) -> None:
    llm = LLM(folder, tensor_parallel_size=2, **KNOBS)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (result,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    out.put(list(result.outputs[0].token_ids))
    llm.llm_engine.shutdown()


def test_two_engines_started_at_once_both_come_up(tmp_path_factory):
    # each engine's rank 0 holds its own rendezvous port: no race for a free one
    folder = str(_checkpoint(tmp_path_factory, "llama", 2))
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    engines = [context.Process(target=_engine_in_a_process, args=(folder, out)) for _ in range(2)]
    for proc in engines:
        proc.start()
    try:
        first, second = out.get(timeout=300), out.get(timeout=300)
    finally:
        for proc in engines:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert first == second and len(first) == 4
    assert [proc.exitcode for proc in engines] == [0, 0]


def _greedy(folder, tp: int, **knobs) -> list[list[int]]:
    """A few prompts' greedy tokens (short: one compact run per strategy)."""
    args = EngineArgs(model=str(folder), tensor_parallel_size=tp, **{**KNOBS, **knobs})
    return engine_greedy(args, PROMPTS[:4], 6)


# each strategy with a budget it accepts (prefill_first never splits a prompt)
STRATEGY_BUDGETS = [("unified", 24), ("chunked_prefill", 24), ("prefill_first", 96)]


@pytest.mark.parametrize(("scheduling", "budget"), STRATEGY_BUDGETS)
def test_two_ranks_generate_the_greedy_tokens_of_one_under_each_strategy(
    tmp_path_factory, scheduling, budget
):
    assert {scheduling for scheduling, _ in STRATEGY_BUDGETS} == set(SCHEDULING_STRATEGIES)
    folder = _checkpoint(tmp_path_factory, "qwen2", 1)
    knobs = dict(scheduling=scheduling, max_num_batched_tokens=budget)
    assert _greedy(folder, 2, **knobs) == _greedy(folder, 1, **knobs)
