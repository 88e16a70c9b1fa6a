"""Quality of a quantized KV cache on a real model (`kv_cache_dtype`): each cache format against
the model's float cache, on real text (this repository's docs/ARCHITECTURE.md, English prose).

- teacher-forced: the text's tokens as one prompt per window (`prompt_logprobs=1`; the prefill
  stores each window's keys and values in the cache and attends over the cache, so every
  position sees quantized keys and values of all before it): the share of positions whose top-1
  token equals the float cache's, and the perplexity of the text;
- greedy: 64-token continuations of 16 prompts (the text's paragraphs' openings), how many are
  identical to the float cache's.

    python benches/kv_quant_quality.py [--model smollm2] [--tokens 2048] \
        [--kv-cache-dtypes int8 fp8_e4m3 fp8_e5m2] [--dtype float32] [--text FILE] \
        [--calibrations 4096 0]

`--calibrations`: each quantized cache once per value of `PAGEDLLM_KV_CALIBRATION` (random token
ids of the start-up key calibration, `worker/kv_calibration.py`; 0: off), against one float run;
each line then says the calibration's start-up seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from pagedllm import LLM, SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def teacher_forced(llm: LLM, windows: list[list[int]]) -> tuple[list[int], list[float]]:
    """Per predicted position: the top-1 token, and the text token's logprob."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    top1, logprobs = [], []
    for window, out in zip(windows, outs):
        for token, step in zip(window[1:], out.prompt_logprobs[1:]):
            top1.append(next(t for t, lp in step.items() if lp.rank == 1))
            logprobs.append(step[token].logprob)
    return top1, logprobs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["int8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--calibrations", nargs="+", default=[None])
    args = p.parse_args()
    text = args.text.read_text()
    reference = None
    runs = [("auto", None)]
    runs += [(kv, cal) for kv in args.kv_cache_dtypes for cal in args.calibrations]
    for kv, calibration in runs:
        if calibration is not None:
            os.environ["PAGEDLLM_KV_CALIBRATION"] = calibration
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=kv, max_model_len=args.window + 64)
        calibrated = llm.llm_engine.cache_engine.key_calibration
        tokenizer = llm.get_tokenizer()
        ids = tokenizer.encode(text)[: args.tokens + 1]
        windows = [ids[i : i + args.window + 1] for i in range(0, len(ids) - 1, args.window)]
        paragraphs = [p for p in text.split("\n\n") if len(p) > 200][:16]
        prompts = [{"prompt_token_ids": tokenizer.encode(p)[:48]} for p in paragraphs]
        greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        top1, logprobs = teacher_forced(llm, windows)
        continuations = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)
        ]
        result = {
            "key_calibration": calibrated.describe() if calibrated else "off",
            "calibration_seconds": round(calibrated.seconds, 2) if calibrated else 0.0,
            "positions": len(top1),
            "perplexity": round(math.exp(-sum(logprobs) / len(logprobs)), 4),
        }
        if reference is None:
            reference = (top1, result["perplexity"], continuations, logprobs)
        else:
            ref_top1, ref_ppl, ref_cont, ref_logprobs = reference
            differ = sum(a != b for a, b in zip(top1, ref_top1))
            result["top1_agreement"] = round(1 - differ / len(top1), 5)
            result["differ"] = differ
            # the text token's logprob's mean move: steadier than the count of flipped near-ties
            moves = [abs(a - b) for a, b in zip(logprobs, ref_logprobs)]
            result["mean_abs_dlogprob"] = round(sum(moves) / len(moves), 5)
            result["perplexity_vs_float"] = round(result["perplexity"] / ref_ppl - 1, 4)
            result["identical_continuations"] = (
                f"{sum(a == b for a, b in zip(continuations, ref_cont))}/{len(ref_cont)}"
            )
        print(json.dumps({"kv_cache_dtype": kv, **result}), flush=True)
        llm.llm_engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
