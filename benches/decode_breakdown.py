"""Where one decode step's time goes at a fixed batch: thread CPU time (`time.thread_time`, so
time other processes hold the core is not counted) of each projection kind, the LM head,
attention, norms, rotary, sampling, scheduling, input preparation, output processing, and the
rest of the step (Python between the ops, small torch ops: adds, embedding; silu and its
product where they are not one call). Where the residual add is fused into the norm
(`RMSNorm.add_and_norm`) it counts under norms; the fused activation under silu_mul. Medians over
the timed steps.

    python benches/decode_breakdown.py --model /tmp/llama56m --batch 1 4 8 --steps 60

Where the model runs fused on the CPU (`models/cpu_forward.py`), a decode step's embedding, layers
and LM head are one Rust call, timed as "fused_logits" (the per-kernel parts then read 0).

Each timed part is wrapped once (a wrapper costs ~1 us per call, counted in "rest").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

PARTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class _Timed:
    """Delegates to the (Rust, read-only) scheduler, timing one of its methods."""

    def __init__(self, inner, method: str, timed) -> None:
        self._inner = inner
        setattr(self, method, timed(method, getattr(inner, method)))

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _time_norm(norm, timed) -> None:
    """Counts a norm under "norms", with the residual add when it is fused into the norm."""
    norm.forward = timed("norms", norm.forward)
    if hasattr(norm, "add_and_norm"):
        norm.add_and_norm = timed("norms", norm.add_and_norm)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/llama56m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()

    from pagedllm import EngineArgs, LLMEngine, SamplingParams
    from pagedllm.models import decoder

    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            max_model_len=args.prompt_len + args.steps + args.warmup_steps + 8,
            cpu_threads=args.cpu_threads,
            disable_log_stats=True,
        )
    )
    acc: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += time.thread_time() - t

        return wrapper

    model = engine.model
    for layer in model.model.layers:
        for name in ("qkv_proj", "o_proj"):
            mod = getattr(layer.self_attn, name)
            mod.forward = timed(name, mod.forward)
        for name in ("gate_up_proj", "down_proj"):
            mod = getattr(layer.mlp, name)
            mod.forward = timed(name, mod.forward)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            _time_norm(norm, timed)
    _time_norm(model.model.norm, timed)
    model.lm_head.forward = timed("lm_head", model.lm_head.forward)
    decoder.paged_attention = timed("attention", decoder.paged_attention)
    decoder.apply_rope_ = timed("rotary", decoder.apply_rope_)
    if hasattr(decoder, "silu_and_mul"):  # the fused activation (older trees: in "rest")
        decoder.silu_and_mul = timed("silu_mul", decoder.silu_and_mul)
    rot = model.model.rotary_emb
    rot.forward = timed("rotary", rot.forward)
    engine.scheduler = _Timed(engine.scheduler, "schedule", timed)
    engine._prepare = timed("prepare", engine._prepare)
    engine._sample = timed("sample", engine._sample)
    engine._update = timed("update", engine._update)
    fused = engine.runner.cpu_forward
    if fused is not None and getattr(fused, "head_rows", None) is not None:
        # the fused CPU decode (models/cpu_forward.py): embedding, layers and LM head in one call,
        # so the parts above inside it read 0 and the call is one part
        fused.logits = timed("fused_logits", fused.logits)

    vocab = engine.model_config.vocab_size
    report = {}
    for batch in args.batch:
        params = SamplingParams(
            temperature=0.0, max_tokens=args.steps + args.warmup_steps + 2, ignore_eos=True
        )
        for i in range(batch):
            ids = [(7 * i + 13 * j + batch) % vocab for j in range(args.prompt_len)]
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": ids}, params)
        while not all(engine.requests[r].seqs[0].token_ids for r in engine.requests):
            engine.step()
        for _ in range(args.warmup_steps):
            engine.step()
        per_step: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.steps):
            acc.clear()
            t = time.thread_time()
            engine.step()
            total = time.thread_time() - t
            parts = dict(acc)
            parts["rest"] = total - sum(parts.values())
            parts["step"] = total
            for k, v in parts.items():
                per_step[k].append(v * 1e3)
        for rid in list(engine.requests):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        report[batch] = {k: round(statistics.median(v), 3) for k, v in per_step.items()}
        print(f"batch {batch}: " + json.dumps(report[batch]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
