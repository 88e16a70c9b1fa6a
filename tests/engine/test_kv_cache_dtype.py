"""`kv_cache_dtype` through the engine (the built-in tiny model on the CPU): a quantized cache holds
more tokens in the same budget (a workload that preempts with float32 does not with int8), and
greedy output over an int8 cache survives prefix caching and preemption (recompute and swap)
unchanged, run after run, with logprobs close to the float cache's."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import KV_CACHE_DTYPES, EngineArgs
from pagedllm.entrypoints.metrics import _EngineCollector

from model_factory import save_tiny_checkpoint

PROMPTS = [np.random.default_rng(s).integers(2, 250, size=40).tolist() for s in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)


def _run(prompts=PROMPTS, **kw):
    kw.setdefault("max_model_len", 256)
    llm = LLM(device="cpu", max_num_seqs=8, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _tokens(outs):
    return [o.token_ids for o in outs]


def test_an_unknown_kv_cache_dtype_is_a_value_error_naming_the_field_and_the_accepted_values():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'bfloat16'"):
        EngineArgs(kv_cache_dtype="int4")
    assert KV_CACHE_DTYPES == ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def test_the_same_budget_holds_more_int8_blocks_and_a_workload_preempts_only_with_float32():
    # 2 MiB: 32 float32 blocks (64 KiB each) for 8 sequences of 80 tokens (40 blocks)
    floats, _ = _run(cpu_kv_cache_space=0.002)
    ints, int_outs = _run(cpu_kv_cache_space=0.002, kv_cache_dtype="int8")
    float_blocks = floats.llm_engine.cache_engine.num_gpu_blocks
    int_blocks = ints.llm_engine.cache_engine.num_gpu_blocks
    # the budget over each block's bytes (4 layers, 4 kv heads, head_dim 32, 16 tokens): int8's
    # 32 codes + a scale byte per row, 3.88x float32's blocks
    budget = int(0.002 * 2**30)
    assert float_blocks == budget // (2 * 4 * 16 * 4 * 32 * 4)
    assert int_blocks == budget // (2 * 4 * 16 * 4 * (32 + 1))
    assert floats.llm_engine.get_stats()["num_preemptions"] > 0
    assert ints.llm_engine.get_stats()["num_preemptions"] == 0
    # the budget changes what fits, not what is computed (the random model's near-ties may flip
    # a token against float32's cache: quality is measured on a real model, benches/RESULTS.md)
    _, roomy_outs = _run(kv_cache_dtype="int8")
    assert _tokens(int_outs) == _tokens(roomy_outs)


def test_get_stats_and_metrics_say_the_kv_dtype_and_the_tokens_held():
    llm, _ = _run(prompts=PROMPTS[:1], kv_cache_dtype="fp8", num_gpu_blocks=40)
    stats = llm.llm_engine.get_stats()
    assert stats["kv_cache_dtype"] == "fp8_e4m3"
    assert stats["kv_cache_num_tokens"] == 40 * 16

    class Server:  # what the collector reads of the server's engine loop
        engine = llm.llm_engine

        class snapshot:  # noqa: N801
            pass

    Server.snapshot.stats = stats
    families = {f.name: f for f in _EngineCollector(Server).collect()}
    info = families["pagedllm:cache_config_info"].samples[0]
    assert info.labels == {"kv_cache_dtype": "fp8_e4m3", "block_size": "16"}
    assert families["pagedllm:kv_cache_num_tokens"].samples[0].value == 640


def test_a_bfloat16_cache_under_float32_holds_twice_the_blocks_with_logprobs_close_to_float32():
    floats, float_outs = _run(cpu_kv_cache_space=0.002)
    halves, half_outs = _run(cpu_kv_cache_space=0.002, kv_cache_dtype="bfloat16")
    # the budget over each block's bytes (4 layers, 4 kv heads, head_dim 32, 16 tokens): 2 bytes
    # a value against float32's 4
    budget = int(0.002 * 2**30)
    assert floats.llm_engine.cache_engine.num_gpu_blocks == budget // (2 * 4 * 16 * 4 * 32 * 4)
    assert halves.llm_engine.cache_engine.num_gpu_blocks == budget // (2 * 4 * 16 * 4 * 32 * 2)
    assert halves.llm_engine.get_stats()["kv_cache_dtype"] == "bfloat16"
    assert floats.llm_engine.get_stats()["num_preemptions"] > 0
    assert halves.llm_engine.get_stats()["num_preemptions"] == 0
    for h, f in zip(half_outs, float_outs):
        for i, (h_token, f_token) in enumerate(zip(h.token_ids, f.token_ids)):
            if h_token != f_token:  # only at a near-tie of float32's own choice
                assert abs(h.logprobs[i][h_token].logprob - f.logprobs[i][f_token].logprob) < 0.05
                break
            # per token, within 0.05 nats of float32's (int8's bound below; the random model's
            # logits are steep: a real model's agreement is in benches/RESULTS.md)
            assert abs(h.logprobs[i][f_token].logprob - f.logprobs[i][f_token].logprob) < 0.05


@pytest.fixture(scope="module")
def int8_reference():
    """int8 outputs with room for every sequence (no preemption, no shared prefix)."""
    _, outs = _run(kv_cache_dtype="int8", enable_prefix_caching=False)
    return outs


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_int8_greedy_output_survives_preemption_and_is_deterministic(
    int8_reference, preemption_mode
):
    kw = dict(kv_cache_dtype="int8", num_gpu_blocks=28, preemption_mode=preemption_mode)
    first, outs = _run(**kw)
    assert first.llm_engine.get_stats()["num_preemptions"] > 0
    _, again = _run(**kw)
    assert _tokens(again) == _tokens(outs)
    assert [o.cumulative_logprob for o in again] == [o.cumulative_logprob for o in outs]
    if preemption_mode == "swap":  # the very bytes come back: the same output as without
        assert _tokens(outs) == _tokens(int8_reference)


def test_int8_greedy_output_through_the_prefix_cache_equals_computing_the_prefix(
    int8_reference,
):
    # each prompt twice: the second copy finds every full block of the first in the cache
    llm, outs = _run(prompts=PROMPTS + PROMPTS, kv_cache_dtype="int8")
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > 0
    assert _tokens(outs[8:]) == _tokens(int8_reference)
    assert _tokens(outs[:8]) == _tokens(int8_reference)


def test_int8_logprobs_are_close_to_the_float32_caches(int8_reference):
    llm = LLM(device="cpu", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
    top2 = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], top2, use_tqdm=False)
    for q, f in zip(int8_reference, [o.outputs[0] for o in outs]):
        for i, (q_token, f_token) in enumerate(zip(q.token_ids, f.token_ids)):
            f_step = f.logprobs[i]
            if q_token != f_token:
                # a sequence may part from float32's only at a near-tie of float32's top two
                first, second = sorted(lp.logprob for lp in f_step.values())[::-1][:2]
                assert first - second < 0.05
                break
            # per token, the chosen token's logprob within 0.05 nats of float32's
            assert abs(q.logprobs[i][f_token].logprob - f_step[f_token].logprob) < 0.05


def test_a_disk_tier_written_with_another_kv_dtype_is_never_loaded(tmp_path, caplog):
    disk = dict(
        kv_offloading_size=0.01,
        kv_offloading_backend="disk",
        kv_offloading_path=str(tmp_path),
        num_gpu_blocks=24,
        max_model_len=80,
        block_size=4,
    )
    prompt = PROMPTS[0]
    writer, _ = _run(prompts=[prompt], **disk)  # float32 blocks on disk
    while writer.llm_engine.has_unfinished_requests():  # the saves' reports
        writer.llm_engine.step()
    writer.llm_engine.shutdown()
    assert any(tmp_path.iterdir())
    reader = LLM(device="cpu", kv_cache_dtype="int8", **disk)
    out = reader.generate({"prompt_token_ids": prompt + [9]}, GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_offloaded_cached_tokens == 0
    assert "written for another model, dtype" in caplog.text
    _, (want,) = _run(prompts=[prompt + [9]], kv_cache_dtype="int8", max_model_len=80)
    assert out.outputs[0].token_ids == want.token_ids


def test_tensor_parallel_ranks_each_hold_their_heads_int8_and_agree_with_one_rank(tmp_path):
    # both ranks calibrate their heads' keys together (its forward's collectives need both)
    folder = save_tiny_checkpoint(tmp_path, "llama", seed=3)
    kw = dict(model=str(folder), kv_cache_dtype="int8", num_gpu_blocks=28, swap_space=0.01)
    _, one = _run(**kw)
    two_ranks, two = _run(tensor_parallel_size=2, cpu_threads=1, **kw)
    # each rank's cache: int8 rows of its half of the kv heads (the tiny llama has 2)
    assert two_ranks.llm_engine.cache_engine.kv_cache.shape[4:] == (1, 16 + 1)
    assert two_ranks.llm_engine.get_stats()["num_preemptions"] > 0
    assert two_ranks.llm_engine.get_stats()["kv_key_calibration"] != "off"
    two_ranks.llm_engine.shutdown()
    assert _tokens(two) == _tokens(one)


def test_the_cli_flag_reaches_the_engine_args_and_refuses_an_unknown_format(capsys):
    from pagedllm.cli.app import _engine_kwargs, build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"])
    assert EngineArgs(**_engine_kwargs(args)).kv_cache_dtype == "fp8_e5m2"
    assert parser.parse_args(["generate", "hi"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
