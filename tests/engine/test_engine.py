"""LLMEngine and LLM behaviours on the built-in default model (CPU)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", block_size=4, max_model_len=128, num_gpu_blocks=256, swap_space=0.01)


def test_generate_returns_outputs_in_prompt_order(llm):
    prompts = ["Hello, my name is", "a", "The quick brown fox"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert [o.prompt_token_ids for o in outs] == [llm.get_tokenizer().encode(p) for p in prompts]


def test_generate_accepts_token_id_dicts_and_per_prompt_params(llm):
    outs = llm.generate(
        [{"prompt_token_ids": [72, 105]}, {"prompt_token_ids": [65]}],
        [
            SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0),
            SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0),
        ],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 6]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_mismatched_per_prompt_params_are_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_text_is_the_detokenized_token_ids(llm):
    (out,) = llm.generate(
        "Hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    completion = out.outputs[0]
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)


def test_seeded_request_samples_the_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    (alone,) = llm.generate("seeded prompt", seeded, use_tqdm=False)
    batch = llm.generate(
        ["other one", "seeded prompt", "and another"], [other, seeded, other], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_stop_string_ends_the_sequence_and_is_reported(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (ref,) = llm.generate("Hello", greedy, use_tqdm=False)
    text = ref.outputs[0].text
    # a 2-character stop string whose first occurrence starts after the first characters
    start = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[start : start + 2]
    (out,) = llm.generate(
        "Hello",
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[: text.index(stop)]


def test_logprobs_are_returned_per_token(llm):
    (out,) = llm.generate(
        "Hi",
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
    )


def test_step_streams_growing_outputs():
    engine = LLMEngine.from_engine_args(
        EngineArgs(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=32)
    )
    engine.add_request(
        "r", "stream", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    lengths = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths.append(len(out.outputs[0].token_ids))
    assert lengths == [1, 2, 3, 4, 5]


def test_priorities_are_accepted_under_the_priority_policy():
    llm = LLM(device="cpu", block_size=4, max_model_len=64, num_gpu_blocks=32, policy="priority")
    outs = llm.generate(
        ["a", "b"], SamplingParams(max_tokens=2, temperature=0.0), priority=[1, 0], use_tqdm=False
    )
    assert all(o.finished for o in outs)


def test_stats_report_queues_usage_hits_and_throughput(llm):
    llm.generate(["stats please"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    stats = llm.engine.get_stats()
    for key in (
        "num_running",
        "num_waiting",
        "num_swapped",
        "kv_usage",
        "prefix_cache_hit_rate",
        "num_preemptions",
        "generation_tokens",
        "generation_throughput",
    ):
        assert key in stats
    assert stats["generation_tokens"] > 0


def test_overload_finishes_every_request_with_unloaded_outputs_and_frees_every_block():
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 250 for j in range(10 + i % 7)]} for i in range(40)
    ]
    unloaded = LLM(device="cpu", block_size=4, max_model_len=32, num_gpu_blocks=400)
    expected = [o.outputs[0].token_ids for o in unloaded.generate(prompts, params, use_tqdm=False)]
    # 8 blocks hold one 32-token sequence; 40 requests want ~8x what the cache holds at once
    overloaded = LLM(
        device="cpu", block_size=4, max_model_len=32, num_gpu_blocks=40, swap_space=0.01
    )
    outs = overloaded.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = overloaded.engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert stats["num_preemptions"] > 0


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate("best of", params, use_tqdm=False)
    assert len(out.outputs) == 2
    (every,) = llm.generate(
        "best of",
        SamplingParams(n=5, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert out.outputs[0].logprobs is None


def test_periodic_stats_log_line_reports_throughput_queues_usage_hits_and_preemptions(caplog):
    llm = LLM(
        device="cpu",
        block_size=4,
        max_model_len=64,
        num_gpu_blocks=32,
        disable_log_stats=False,
        stats_log_interval=0.0,
    )
    with caplog.at_level("INFO", logger="pagedllm"):
        llm.generate(["log me"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    line = caplog.records[-1].getMessage()
    for part in (
        "generation",
        "tok/s",
        "running",
        "waiting",
        "swapped",
        "KV usage",
        "prefix hit rate",
        "preemptions",
    ):
        assert part in line


def test_metrics_and_cached_tokens_are_recorded_at_first_scheduling(llm):
    prefix = list(range(1, 40))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": prefix + [50]}, params, use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": prefix + [60]}, params, use_tqdm=False)
    metrics = out.metrics
    assert metrics.first_scheduled_time is not None and metrics.time_in_queue >= 0
    assert metrics.first_token_time >= metrics.first_scheduled_time
    assert out.num_cached_tokens == 36  # 9 full blocks of 4 reused from the first request
    assert not llm.engine._unscheduled


@pytest.mark.parametrize(
    "prompt",
    [
        "Answer yes or no: \ufffd",  # the text ends in U+FFFD
        {"prompt_token_ids": list("Answer yes or no: €".encode())[:-1]},  # inside a character
    ],
    ids=["u-fffd", "cut-character"],
)
def test_a_choice_after_a_prompt_ending_in_u_fffd_is_exactly_the_choice(llm, prompt):
    from pagedllm import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text in ("yes", "no")
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids)


def test_server_engine_prefills_a_burst_in_chunks_with_the_same_greedy_tokens():
    """A burst over the server's token budget is prefilled a chunk per step (the first prompts
    produce a token before the last are computed), and greedy outputs equal the offline
    engine's, which takes the burst in one step."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(300)] for i in range(8)]  # 2,400 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    first_steps = {}
    for context in ("offline", "server"):
        engine = LLMEngine.from_engine_args(
            EngineArgs(device="cpu", max_model_len=512, num_gpu_blocks=200, usage_context=context)
        )
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.outputs[0].token_ids:
                    first_steps.setdefault((context, out.request_id), step)
                if out.finished:
                    tokens[(context, out.request_id)] = out.outputs[0].token_ids
    assert all(tokens[("server", str(i))] == tokens[("offline", str(i))] for i in range(8))
    assert {first_steps[("offline", str(i))] for i in range(8)} == {1}
    server_first = [first_steps[("server", str(i))] for i in range(8)]
    assert server_first[0] == 1 and server_first[-1] > 1
