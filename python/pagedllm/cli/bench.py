"""Offline throughput benchmark (`pagedllm bench`), optionally side by side with `transformers`
and with vLLM running in another interpreter (`vllm_compare.py`)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()


def random_lengths(num_prompts: int, low: int, high: int, rng: np.random.Generator) -> list[int]:
    """Lengths drawn uniformly from [low, high]; all `high` when low == high."""
    if low == high:
        return [high] * num_prompts
    return rng.integers(low, high + 1, size=num_prompts).tolist()


def bench_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    min_input_len: int | None = None,
    min_output_len: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Random prompts and their output lengths; lengths uniform in [min, max] when a minimum is
    given (fixed-length prompts are the same as `random_prompts`)."""
    low_in = input_len if min_input_len is None else min_input_len
    low_out = output_len if min_output_len is None else min_output_len
    for name, low, high in (("input", low_in, input_len), ("output", low_out, output_len)):
        if not 1 <= low <= high:
            raise ValueError(f"bench --min-{name}-len {low} must be in [1, --{name}-len {high}]")
    if low_in == input_len:
        prompts = random_prompts(num_prompts, input_len, vocab_size, seed)
        rng = np.random.default_rng(seed + 1)
    else:
        rng = np.random.default_rng(seed)
        lengths = random_lengths(num_prompts, low_in, input_len, rng)
        prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]
    return prompts, random_lengths(num_prompts, low_out, output_len, rng)


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"bench {name} must be an integer >= 1, got {value!r}")


def check_lengths(
    input_len: int, output_len: int, max_model_len: int, max_prompt_len: int | None = None
) -> None:
    """Refuse a workload whose sequences cannot fit: its prompts would be ignored or cut short.

    `max_prompt_len` is the longest prompt the scheduler accepts when that is below
    `max_model_len` (prefill_first never splits a prompt over `max_num_batched_tokens`).
    """
    _check_counts(input_len=input_len, output_len=output_len, max_model_len=max_model_len)
    longest = max_model_len if max_prompt_len is None else min(max_model_len, max_prompt_len)
    if input_len > longest:
        if longest == max_model_len:
            limit, knob = f"max_model_len={max_model_len}", "--max-model-len"
        else:
            limit = f"max_num_batched_tokens={longest} (prefill_first never splits a prompt)"
            knob = "--max-num-batched-tokens"
        raise ValueError(
            f"bench prompts of --input-len {input_len} tokens are longer than {limit}: "
            f"every prompt would be ignored; lower --input-len or raise {knob}"
        )
    if input_len + output_len > max_model_len:
        raise ValueError(
            f"bench sequences of --input-len {input_len} + --output-len {output_len} = "
            f"{input_len + output_len} tokens exceed max_model_len={max_model_len}: "
            f"every output would be cut short; lower the lengths or raise "
            f"--max-model-len"
        )


def _ignored(output) -> bool:
    """A request that never ran: finished without a token (as "length" with the scheduler's
    reason when its prompt can never fit, or aborted), so neither its prompt nor it is counted."""
    return all(not c.token_ids for c in output.outputs)


def run_bench(
    *,
    engine_kwargs: dict,
    num_prompts: int,
    input_len: int,
    output_len: int,
    compare_transformers: bool = False,
    seed: int = 0,
    min_input_len: int | None = None,
    min_output_len: int | None = None,
    rounds: int = 1,
    compare_vllm_python: str | None = None,
) -> dict:
    """Greedy generation of `output_len` tokens (EOS ignored) for random prompts.

    With `min_input_len` / `min_output_len` each prompt's lengths are drawn uniformly from
    [min, max]. The workload runs `rounds` times and the median is reported; with
    `compare_vllm_python` vLLM runs it in that interpreter too, alternating with ours round by
    round, and the result adds its median, the ratio and how many prompts got the same greedy
    tokens from both.

    Returns tokens/s, the mean step time split into schedule / forward (block ops, input
    preparation and the forward pass) / sample / update, and with `compare_transformers` the
    same workload through `transformers` generate and the throughput ratio.

    Refuses (`ValueError`) lengths that cannot fit the engine's `max_model_len`. A prompt the
    engine still ignores (no token generated) is counted in `ignored_prompts`, with the
    scheduler's reason in `ignored_reason`, and not in the throughput, which counts only the
    prompt tokens of requests that ran and the tokens actually generated.
    """
    _check_counts(
        num_prompts=num_prompts, input_len=input_len, output_len=output_len, rounds=rounds
    )

    from pagedllm import LLM, SamplingParams
    from pagedllm.cli.vllm_compare import check_interpreter, greedy_agreement

    if compare_vllm_python is not None:
        check_interpreter(compare_vllm_python)
    # token ids in and out, like the vLLM driver: no tokenizer needed, no detokenizing timed
    llm = LLM(**{"skip_tokenizer_init": True, **engine_kwargs})
    engine = llm.engine
    prefill_first = engine.args.scheduling == "prefill_first"
    check_lengths(
        input_len,
        output_len,
        engine.max_model_len,
        engine.max_num_batched_tokens if prefill_first else None,
    )
    vocab = engine.model_config.vocab_size
    prompts, max_tokens = bench_workload(
        num_prompts, input_len, output_len, vocab, seed, min_input_len, min_output_len
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up
    vllm = None
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-") as tmp:
        if compare_vllm_python is not None:
            vllm = _start_vllm(compare_vllm_python, engine, Path(tmp), prompts, max_tokens, seed)
        try:
            runs, vllm_runs = [], []
            for _ in range(rounds):
                runs.append(_timed_generate(llm, inputs, params))
                if vllm is not None:
                    vllm_runs.append(vllm.run())
        finally:
            if vllm is not None:
                vllm.close()
    median = statistics.median(r[0] for r in runs)
    # the step timings and outputs of the round nearest the median; the rates are medians
    elapsed, outputs, timings = min(runs, key=lambda r: abs(r[0] - median))
    engine.timings = timings
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    # as vLLM's rounds are summarized: the median of the rounds' rates (with an even count of
    # rounds the round nearest the median is one of the middle two, not their median)
    rate = statistics.median(generated / r[0] for r in runs)
    ignored = [o for o in outputs if _ignored(o)]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs if not _ignored(o))
    result = {
        "model": engine_kwargs.get("model"),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "min_input_len": min_input_len or input_len,
        "min_output_len": min_output_len or output_len,
        "rounds": rounds,
        "elapsed_s": elapsed,
        "output_tokens_per_s_runs": [generated / r[0] for r in runs],
        "completed_prompts": len(outputs) - len(ignored),
        "ignored_prompts": len(ignored),
        "ignored_reason": (ignored[0].outputs[0].stop_reason or ignored[0].outputs[0].finish_reason)
        if ignored
        else None,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "output_tokens_per_s": rate,
        "total_tokens_per_s": rate * (generated + prompt_tokens) / generated if generated else 0.0,
        "steps": engine.timings.steps,
        "mean_step_ms": engine.timings.mean_ms(),
    }
    if vllm is not None:
        result["vllm"] = _vllm_summary(vllm.version, vllm_runs)
        result["speedup_vs_vllm"] = (
            result["output_tokens_per_s"] / result["vllm"]["output_tokens_per_s"]
        )
        ours = [list(o.outputs[0].token_ids) for o in outputs]
        theirs = vllm_runs[-1]["outputs"]
        result["greedy_agreement_vs_vllm"] = f"{greedy_agreement(ours, theirs)}/{len(ours)}"
    if compare_transformers:
        if len(set(max_tokens)) > 1 or min_input_len not in (None, input_len):
            raise ValueError(
                "bench --compare-transformers runs one padded batch: it needs fixed lengths "
                "(no --min-input-len / --min-output-len)"
            )
        hf = _transformers_generate(engine, prompts, output_len)
        result["transformers"] = hf
        result["speedup_vs_transformers"] = (
            result["output_tokens_per_s"] / hf["output_tokens_per_s"]
        )
    result["summary"] = _summary(result)
    return result


def _timed_generate(llm, inputs: list, params: list) -> tuple:
    """(elapsed seconds, outputs, step timings) of one generate over the whole workload."""
    from pagedllm.engine import StepTimings

    engine = llm.engine
    engine.timings = StepTimings()
    _sync(engine.device)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    _sync(engine.device)
    return time.perf_counter() - start, outputs, engine.timings


def _start_vllm(python: str, engine, folder: Path, prompts, max_tokens, seed: int):
    from pagedllm.cli.vllm_compare import VllmProcess, export_checkpoint

    return VllmProcess(
        python,
        model=export_checkpoint(engine, folder),
        dtype=str(engine.dtype).replace("torch.", ""),
        max_model_len=engine.max_model_len,
        seed=seed,
        prompts=prompts,
        max_tokens=max_tokens,
        kv_cache_space_gib=engine.args.cpu_kv_cache_space,
        tensor_parallel_size=engine.args.tensor_parallel_size,
    )


def _vllm_summary(version: str, runs: list[dict]) -> dict:
    rates = [r["generated_tokens"] / r["elapsed_s"] for r in runs]
    return {
        "version": version,
        "output_tokens_per_s_runs": rates,
        "output_tokens_per_s": statistics.median(rates),
        "generated_tokens": runs[-1]["generated_tokens"],
    }


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _transformers_generate(engine, prompts: list[list[int]], output_len: int) -> dict:
    """The same prompts through `transformers` generate (greedy, one batch, same weights)."""
    import torch

    from pagedllm.models.hf_export import to_transformers

    model = to_transformers(engine.model, engine.model_config)
    batch = torch.tensor(prompts, dtype=torch.long, device=engine.device)
    kwargs = dict(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        attention_mask=torch.ones_like(batch),
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(batch[:2], **{**kwargs, "attention_mask": torch.ones_like(batch[:2])})
        _sync(engine.device)
        start = time.perf_counter()
        out = model.generate(batch, **kwargs)
        _sync(engine.device)
        elapsed = time.perf_counter() - start
    generated = int(out.shape[0] * (out.shape[1] - batch.shape[1]))
    return {
        "elapsed_s": elapsed,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
    }


def _summary(r: dict) -> str:
    steps = ", ".join(f"{k} {v:.2f}" for k, v in r["mean_step_ms"].items())
    lines = [
        f"{r['model']} on {r['device']} ({r['dtype']}): {r['num_prompts']} prompts x "
        f"{_span(r['min_input_len'], r['input_len'])} in / "
        f"{_span(r['min_output_len'], r['output_len'])} out, median of {r['rounds']}",
        f"pagedllm: {r['output_tokens_per_s']:.1f} output tok/s, {r['total_tokens_per_s']:.1f} "
        f"total tok/s, {r['steps']} steps in {r['elapsed_s']:.2f} s",
        f"mean step (ms): {steps}",
    ]
    if r["ignored_prompts"]:
        lines.insert(
            1,
            f"WARNING: {r['ignored_prompts']} of {r['num_prompts']} prompts ignored "
            f"({r['ignored_reason']}); throughput counts only the "
            f"{r['completed_prompts']} that ran",
        )
    if "vllm" in r:
        v = r["vllm"]
        lines.append(
            f"vLLM {v['version']}: {v['output_tokens_per_s']:.1f} output tok/s (median of "
            f"{len(v['output_tokens_per_s_runs'])}); pagedllm / vLLM = "
            f"{r['speedup_vs_vllm']:.2f}x; greedy agreement {r['greedy_agreement_vs_vllm']}"
        )
    if "transformers" in r:
        hf = r["transformers"]
        lines.append(
            f"transformers generate: {hf['output_tokens_per_s']:.1f} output tok/s in "
            f"{hf['elapsed_s']:.2f} s; pagedllm / transformers = "
            f"{r['speedup_vs_transformers']:.2f}x"
        )
    return "\n".join(lines)


def _span(low: int, high: int) -> str:
    return str(high) if low == high else f"U[{low}, {high}]"
