"""Offline throughput benchmark (`pagedllm bench`), optionally side by side with `transformers`."""

from __future__ import annotations

import time

import numpy as np


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, input_len)).tolist()


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
) -> dict:
    """Greedy generation of `output_len` tokens (EOS ignored) for random prompts.

    Returns tokens/s, the mean step time split into schedule / forward (block ops, input
    preparation and the forward pass) / sample / update, and with `compare_transformers` the
    same workload through `transformers` generate and the throughput ratio.

    Refuses (`ValueError`) lengths that cannot fit the engine's `max_model_len`. A prompt the
    engine still ignores (no token generated) is counted in `ignored_prompts`, with the
    scheduler's reason in `ignored_reason`, and not in the throughput, which counts only the
    prompt tokens of requests that ran and the tokens actually generated.
    """
    _check_counts(num_prompts=num_prompts, input_len=input_len, output_len=output_len)

    from pagedllm import LLM, SamplingParams
    from pagedllm.engine import StepTimings

    llm = LLM(**engine_kwargs)
    engine = llm.engine
    prefill_first = engine.args.scheduling == "prefill_first"
    check_lengths(
        input_len,
        output_len,
        engine.max_model_len,
        engine.max_num_batched_tokens if prefill_first else None,
    )
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    engine.timings = StepTimings()
    _sync(engine.device)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ignored = [o for o in outputs if _ignored(o)]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs if not _ignored(o))
    result = {
        "model": engine_kwargs.get("model"),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_s": elapsed,
        "completed_prompts": len(outputs) - len(ignored),
        "ignored_prompts": len(ignored),
        "ignored_reason": (ignored[0].outputs[0].stop_reason or ignored[0].outputs[0].finish_reason)
        if ignored
        else None,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + prompt_tokens) / elapsed,
        "steps": engine.timings.steps,
        "mean_step_ms": engine.timings.mean_ms(),
    }
    if compare_transformers:
        hf = _transformers_generate(engine, prompts, output_len)
        result["transformers"] = hf
        result["speedup_vs_transformers"] = (
            result["output_tokens_per_s"] / hf["output_tokens_per_s"]
        )
    result["summary"] = _summary(result)
    return result


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
        f"{r['input_len']} in / {r['output_len']} out",
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
    if "transformers" in r:
        hf = r["transformers"]
        lines.append(
            f"transformers generate: {hf['output_tokens_per_s']:.1f} output tok/s in "
            f"{hf['elapsed_s']:.2f} s; pagedllm / transformers = "
            f"{r['speedup_vs_transformers']:.2f}x"
        )
    return "\n".join(lines)
