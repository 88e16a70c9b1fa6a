"""Randomized workloads (Hypothesis) over every strategy x policy x preemption mode.

Arrivals, aborts, priorities, n, grammars that compile (or fail) some steps later, sampled tokens
(with EOS and stop ids in a tiny vocabulary) and tiny pools are generated. After every step: the
core's invariants (manager + queues), budgets, the step arrays' consistency, every live request in
exactly one queue, progress (a step with work computes a token or ends a request) and no swap
ping-pong (a group swapped back in computes its tokens in that step), at most `max_loras` adapters
per step, no request scheduled while its grammar compiles and exactly the samples of the others
with a grammar masked. Some workloads speculate (n-gram drafts every step, a random prefix of each
accepted, the drafts at the end of their rows' tokens). Some workloads discard random steps
(`discard_step`, as an engine does when a forward fails): nothing is lost. At the end: every
request finished or aborted within a bounded number of steps, every block free."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm._core import Scheduler

CONFIGS = list(
    itertools.product(
        ["prefill_first", "chunked_prefill", "unified"],
        ["fcfs", "priority"],
        [None, "recompute", "swap"],
    )
)
# each configuration's workloads together run at least this many steps
MIN_STEPS_PER_CONFIG = 2000 // len(CONFIGS) + 1
VOCAB = 6  # token 0 is EOS, 5 a stop id: both show up often

request_st = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, 3), min_size=1, max_size=24),
        "n": st.integers(1, 3),
        "priority": st.integers(0, 3),
        "max_tokens": st.integers(1, 10),
        "min_tokens": st.integers(0, 2),
        "eos": st.booleans(),
        "stop": st.booleans(),
        "ignore_eos": st.booleans(),
        "lora": st.integers(0, 3),  # its adapter when the workload enables LoRA
        # structured output: its grammar compiles (or fails) some steps after it is added
        "grammar": st.sampled_from([None, None, "compiles", "fails"]),
    }
)

workload_st = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "gpu_slots": st.integers(24, 96),
        "num_cpu_blocks": st.integers(0, 12),
        "budget": st.integers(8, 64),
        "max_num_seqs": st.integers(1, 8),
        "max_model_len": st.integers(12, 48),
        "watermark": st.sampled_from([0.0, 0.1]),
        "threshold": st.sampled_from([0, 3]),
        "lookahead": st.sampled_from([0, 0, 2]),
        "caching": st.booleans(),
        "max_loras": st.sampled_from([0, 1, 2]),  # 0: LoRA off
        "fault_rate": st.sampled_from([0.0, 0.0, 0.15]),  # steps discarded as if they had failed
        # speculative decoding: n-gram drafts per step (0: off), each accepted at random
        "spec": st.sampled_from([0, 0, 3]),
        # per step: new requests, then aborts (indices into the requests added so far)
        "steps": st.lists(
            st.tuples(st.lists(request_st, max_size=3), st.lists(st.integers(0, 40), max_size=1)),
            min_size=5,
            max_size=25,
        ),
        "seed": st.integers(0, 2**32 - 1),
    }
)


def check_step(s: Scheduler, out, cfg: dict, live: set[str]) -> None:
    s.check_invariants()
    assert out.num_batched_tokens <= s.max_num_batched_tokens
    assert out.num_seqs <= cfg["max_num_seqs"]
    stats = s.get_stats()
    assert stats["num_running_seqs"] <= cfg["max_num_seqs"]
    queues = s.waiting_ids() + s.running_ids() + s.swapped_ids()
    assert len(queues) == len(set(queues)), "a request sits in two queues"
    pending_ignored = {r for r in live if s.request_status(r) == "FINISHED_IGNORED"}
    assert set(queues) | pending_ignored == live, "a request is lost or unknown"
    # the arrays agree with each other
    qsl = out.query_start_loc
    assert qsl[-1] == out.num_batched_tokens == len(out.slot_mapping)
    bs = s.block_size
    for row in range(out.num_seqs):
        pos = out.positions[qsl[row] : qsl[row + 1]]
        slots = out.block_tables[row][pos // bs] * bs + pos % bs
        assert (out.slot_mapping[qsl[row] : qsl[row + 1]] == slots).all()
        assert out.seq_lens[row] <= s.max_model_len
    loras = set(out.lora_ids.tolist()) - {0}
    assert len(out.lora_ids) == out.num_seqs and len(loras) <= cfg["max_loras"], loras
    assert ((out.sample_rows >= 0) & (out.sample_rows < max(out.num_seqs, 1))).all()
    slots = out.slot_mapping
    assert len(np.unique(slots)) == len(slots), "two tokens write one KV slot"
    drafts = out.spec_num_draft_tokens
    assert len(drafts) == out.num_seqs and drafts.sum() == len(out.spec_draft_token_ids)
    for row, start in zip(np.flatnonzero(drafts), draft_offsets(out)[drafts > 0]):
        d = drafts[row]
        run = out.spec_draft_token_ids[start : start + d]
        assert (out.input_ids[qsl[row + 1] - d : qsl[row + 1]] == run).all()


def draft_offsets(out) -> np.ndarray:
    """Where each row's drafts start in `spec_draft_token_ids`."""
    drafts = out.spec_num_draft_tokens.astype(np.int64)
    return np.cumsum(drafts) - drafts


def verified_runs(out, rng) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: a random number of its drafts accepted, then a fresh token."""
    drafts = out.spec_num_draft_tokens
    offsets = draft_offsets(out)
    tokens, runs = [], []
    for row in out.sample_rows:
        accepted = int(rng.integers(0, drafts[row] + 1))
        tokens.extend(out.spec_draft_token_ids[offsets[row] : offsets[row] + accepted])
        tokens.append(int(rng.integers(0, VOCAB)))
        runs.append(accepted + 1)
    return np.array(tokens, dtype=np.int64), np.array(runs, dtype=np.int64)


def run_workload(scheduling, policy, mode, w) -> int:
    bs = w["block_size"]
    cfg = {"max_num_seqs": w["max_num_seqs"], "max_loras": w["max_loras"]}
    s = Scheduler(
        block_size=bs,
        num_gpu_blocks=max(w["gpu_slots"] // bs, 2),
        num_cpu_blocks=w["num_cpu_blocks"],
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        max_model_len=w["max_model_len"],
        scheduling=scheduling,
        policy=policy,
        preemption_mode=mode,
        enable_prefix_caching=w["caching"],
        watermark=w["watermark"],
        long_prefill_token_threshold=w["threshold"],
        num_lookahead_slots=w["lookahead"],
        max_loras=w["max_loras"],
        num_speculative_tokens=w["spec"],
        prompt_lookup_max=3,
        prompt_lookup_min=1,
    )
    rng = np.random.default_rng(w["seed"])
    live: set[str] = set()
    added: list[str] = []
    work = 0
    steps = 0
    finished_once: set[str] = set()
    compiling: dict[str, str] = {}  # request -> what its grammar compile will do
    structured: set[str] = set()

    def finish(rid: str) -> None:
        assert rid not in finished_once, f"{rid} finished twice"
        finished_once.add(rid)
        live.discard(rid)

    def grammars_settle() -> None:
        """Some compiles end: the grammar is ready, or it failed and the request is aborted."""
        for rid in list(compiling):
            if rng.random() < 0.6:
                continue
            outcome = compiling.pop(rid)
            if rid not in live or s.request_status(rid) == "FINISHED_IGNORED":
                continue  # aborted meanwhile, or reported as never servable by the next step
            if outcome == "compiles":
                assert s.grammar_ready(rid) is True
                assert s.grammar_ready(rid) is False, "marked once"
            else:
                s.abort_request(rid)
                finish(rid)

    def check_grammar(out) -> None:
        """Only ready structured requests sample under a mask; they take drafts like the
        others (the engine cuts them to what the grammar accepts before the step)."""
        ids = out.sample_request_ids
        masked = [ids[k] for k in out.structured_output_samples]
        assert masked == [r for r in ids if r in structured], (masked, ids)
        assert not compiling.keys() & set(out.request_ids), "scheduled while compiling"

    def one_step() -> None:
        nonlocal steps
        grammars_settle()
        # requests whose grammar compiles cannot run: a step with only those does nothing
        had_work = s.has_unfinished_requests() and bool(live - compiling.keys())
        swapped_before = set(s.swapped_ids())
        out = s.schedule()
        check_grammar(out)
        # liveness: a step with work left computes a token or ends a request, and a group
        # swapped back in computes its tokens in that same step (no swap ping-pong)
        assert not had_work or out.num_batched_tokens > 0 or out.finished, (
            f"step {steps} scheduled nothing: {s.get_stats()}"
        )
        swapped_in = swapped_before.intersection(s.running_ids())
        assert swapped_in <= set(out.request_ids), f"swapped in without tokens: {swapped_in}"
        for rid, reason in out.finished:
            assert reason
            finish(rid)
        if rng.random() < w["fault_rate"]:
            # the step "failed": taken back, its requests recompute later, nothing is lost
            rolled_back = s.discard_step(out)
            assert set(rolled_back) >= set(out.request_ids) - set(out.finished)
            assert all(s.request_status(r) == "PREEMPTED" for r in rolled_back)
            check_step(s, out, cfg, live)
            steps += 1
            if w["spec"]:
                s.propose_drafts()
            return
        if w["spec"]:
            sampled, runs = verified_runs(out, rng)
            finished = s.update_from_output(out, sampled, num_tokens=runs)
        else:
            sampled = rng.integers(0, VOCAB, out.num_samples)
            finished = s.update_from_output(out, sampled)
        for rid, _, reason, _, request_done in finished:
            assert reason in ("stop", "length")
            if request_done:
                finish(rid)
        check_step(s, out, cfg, live)
        steps += 1
        if w["spec"]:
            s.propose_drafts()

    for arrivals, aborts in w["steps"]:
        for r in arrivals:
            rid = f"r{len(added)}"
            if r["n"] > w["max_num_seqs"]:  # refused up front, nothing queued
                with pytest.raises(ValueError, match="max_num_seqs"):
                    s.add_request(rid, r["prompt"], n=r["n"])
                assert s.request_status(rid) is None
                continue
            s.add_request(
                rid,
                r["prompt"],
                n=r["n"],
                priority=r["priority"],
                max_tokens=r["max_tokens"],
                min_tokens=min(r["min_tokens"], r["max_tokens"]),
                eos_token_id=0 if r["eos"] else None,
                stop_token_ids=[5] if r["stop"] else None,
                ignore_eos=r["ignore_eos"],
                lora_id=r["lora"] if w["max_loras"] else 0,
                structured_output=r["grammar"] is not None,
            )
            if r["grammar"] is not None:
                compiling[rid] = r["grammar"]
                structured.add(rid)
            added.append(rid)
            live.add(rid)
            work += r["n"] * (len(r["prompt"]) + r["max_tokens"])
        for i in aborts:
            if i < len(added):
                rid = added[i]
                s.abort_request(rid)
                if rid in live:
                    finish(rid)
        one_step()
    bound = 200 + 20 * work  # recompute may redo work; no livelock may exceed this
    w["fault_rate"] = 0.0  # the drain below must end
    while s.has_unfinished_requests():
        assert steps < bound, f"no progress after {steps} steps: {s.get_stats()}"
        one_step()
    assert not live
    stats = s.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
    s.check_invariants()
    return steps


@pytest.mark.parametrize("scheduling, policy, mode", CONFIGS)
def test_random_workload_keeps_invariants_and_frees_everything(scheduling, policy, mode):
    """Each configuration runs its own random workloads, and enough steps of them that the
    check is not vacuous (18 configurations x 12 workloads cover >= 2,000 steps in all)."""
    steps = []

    @settings(
        max_examples=int(os.environ.get("PAGEDLLM_SCHED_EXAMPLES", "12")),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(w=workload_st)
    def run(w):
        steps.append(run_workload(scheduling, policy, mode, w))

    run()
    assert sum(steps) >= MIN_STEPS_PER_CONFIG, steps
