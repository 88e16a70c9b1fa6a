"""Speculative decoding (issue 11): the scheduler's cost with drafts, and end to end on CPU with
and without n-gram speculation.

1. `schedule()` with k = 4 drafts per sequence at 1024 running (prompt 512, block 16, prefix
   caching on and off), against the plain steady decode of `test_bench_vs_nanovllm.py` (run both
   in the same minutes). Each round's setup applies the previous step (every draft rejected, so
   the histories keep recurring and every sequence gets 4 drafts again) and proposes; the timed
   part is `schedule()` alone. `test_pagedllm_spec_step` times the whole scheduling side of a
   speculative step: `propose_drafts` + `schedule` + `update_from_output(num_tokens=...)`.
2. End to end, the built-in CPU model, greedy: prompts that repeat their own text (a 16-token
   passage repeated, as an edit of code repeats it), with and without speculation (n-gram, and
   the built-in model as its own draft model: the draft-model method's upper bound). Reported in
   `extra_info`: target forwards (engine steps) per output token of a single request, acceptance
   rate, mean accepted length, tokens/s of a batch.

Run: python -m pytest benches/test_bench_spec_decode.py --benchmark-only \
        --benchmark-columns=median,iqr,rounds
Results: benches/RESULTS.md, "Speculative decoding (issue 11)".
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm._core import Scheduler

RUNNING, PROMPT, MAX_MODEL_LEN, K = 1024, 512, 2048, 4
ROUNDS = 200


def spec_scheduler(caching: bool) -> Scheduler:
    s = Scheduler(
        block_size=16,
        max_num_seqs=RUNNING,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=16384,
        enable_prefix_caching=caching,
        num_gpu_blocks=RUNNING * (MAX_MODEL_LEN // 16 + 1),
        num_speculative_tokens=K,
        prompt_lookup_max=4,
        prompt_lookup_min=1,
    )
    rng = np.random.default_rng(0)
    for i in range(RUNNING):
        # a 32-token passage repeated: its suffix always recurs
        s.add_request(f"r{i}", np.tile(rng.integers(0, 50_000, 32), PROMPT // 32), max_tokens=1024)
    while True:  # prefill everything first
        out = s.schedule()
        s.update_from_output(out, np.full(out.num_samples, 7, dtype=np.int64))
        if out.is_decode_only and out.num_seqs == RUNNING:
            break
    return s


def reject_all(s: Scheduler, out) -> None:
    """Applies `out` with every draft rejected (one fresh token per sample)."""
    n = out.num_samples
    s.update_from_output(out, np.full(n, 7, dtype=np.int64), num_tokens=np.ones(n, np.int64))


@pytest.mark.parametrize("caching", [True, False])
def test_pagedllm_schedule_with_drafts(benchmark, caching):
    s = spec_scheduler(caching)
    last = [None]

    def setup():
        if last[0] is not None:
            reject_all(s, last[0])
        s.propose_drafts()

    def schedule():
        last[0] = s.schedule()

    benchmark.pedantic(schedule, setup=setup, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    out = last[0]
    assert out.num_seqs == RUNNING and out.num_batched_tokens == RUNNING * (K + 1)
    benchmark.extra_info["draft_tokens_per_step"] = int(out.spec_num_draft_tokens.sum())


@pytest.mark.parametrize("caching", [True, False])
def test_pagedllm_spec_step(benchmark, caching):
    s = spec_scheduler(caching)
    s.propose_drafts()

    def step():
        out = s.schedule()
        reject_all(s, out)
        s.propose_drafts()

    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=10, iterations=1)
    assert s.num_running() == RUNNING and s.get_stats()["num_preemptions"] == 0


# ---- end to end on CPU ---------------------------------------------------------------------

PASSAGE, REPEATS, OUTPUT_LEN, BATCH = 16, 6, 64, 8
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4}
# the draft-model method's bound: the target as its own draft (every greedy draft accepted)
SELF_DRAFT = {"method": "draft_model", "model": "pagedllm/tiny-random", "num_speculative_tokens": K}


def repeating_prompts(vocab: int, count: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [
        {"prompt_token_ids": np.tile(rng.integers(0, vocab, PASSAGE), REPEATS).tolist()}
        for _ in range(count)
    ]


@pytest.mark.parametrize("spec", [None, NGRAM, SELF_DRAFT], ids=["plain", "ngram", "self_draft"])
def test_cpu_generate_repeating_text(benchmark, spec):
    # one torch thread: on the shared 2-core machine extra threads spin and skew small GEMMs
    llm = LLM(device="cpu", max_model_len=512, speculative_config=spec, cpu_threads=1)
    engine = llm.llm_engine
    prompts = repeating_prompts(engine.model_config.vocab_size, BATCH)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    # one request alone: engine steps (target forwards) per output token
    before = engine.get_stats()
    llm.generate(prompts[:1], params, use_tqdm=False)
    after = engine.get_stats()
    steps = after["num_steps"] - before["num_steps"] - 1  # the prefill step samples one token
    benchmark.extra_info["forwards_per_output_token"] = (steps + 1) / OUTPUT_LEN
    outs = benchmark.pedantic(
        llm.generate, args=(prompts, params), kwargs={"use_tqdm": False}, rounds=3, warmup_rounds=1
    )
    assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outs)
    stats = engine.get_stats()
    drafts, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    if drafts:
        benchmark.extra_info["acceptance_rate"] = accepted / drafts
        benchmark.extra_info["mean_accepted_length"] = accepted / stats["spec_decode_num_drafts"]
    benchmark.extra_info["output_tokens"] = BATCH * OUTPUT_LEN
