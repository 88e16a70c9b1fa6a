"""Multi-LoRA throughput: the same batch with 0, 1, 2 and 4 adapters among its requests, against
the base model (an engine without LoRA), in one run.

Adapters are random rank-16 PEFT folders on every projection of the built-in model (the most a
step can do). Each case takes the median of `ROUNDS` generate calls; the cases are interleaved
round by round so a noisy machine skews them alike.

Run: python benches/test_bench_lora.py  (prints the table of benches/RESULTS.md)
  or python -m pytest benches/test_bench_lora.py -s
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.cli.bench import random_prompts
from pagedllm.lora.adapter import ModelLoRASpec

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, RANK, ROUNDS = 16, 64, 32, 16, 3
GROUP = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapter(folder: Path, spec: ModelLoRASpec, seed: int) -> Path:
    """A random PEFT LoRA folder (PEFT's file names, config and weight keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for proj, (d_in, d_out) in spec.shapes.items():
            key = f"base_model.model.model.layers.{layer}.{GROUP[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, d_in, generator=g) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, RANK, generator=g) / RANK**0.5
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(GROUP)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run(out=sys.stdout) -> dict[str, float]:
    kwargs = dict(device="cpu", max_model_len=256, max_num_seqs=64)
    base = LLM(**kwargs)
    lora = LLM(**kwargs, enable_lora=True, max_loras=4, max_lora_rank=RANK)
    spec = ModelLoRASpec.of(lora.engine.model_config)
    tmp = Path(tempfile.mkdtemp(prefix="pagedllm-lora-bench-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", spec, i))) for i in range(4)
    ]
    prompts = [
        {"prompt_token_ids": p}
        for p in random_prompts(NUM_PROMPTS, INPUT_LEN, lora.engine.model_config.vocab_size, 0)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    cases = {"base model, LoRA off": (base, None)}
    for k in (0, 1, 2, 4):
        # k adapters spread over the batch (requests i % k); k = 0: LoRA on, no adapter used
        loras = [adapters[i % k] if k else None for i in range(NUM_PROMPTS)]
        cases[f"LoRA on, {k} adapter(s) in the batch"] = (lora, loras)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS + 1):  # the first round warms up
        for name, (llm, loras) in cases.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == NUM_PROMPTS * OUTPUT_LEN
    tokens = NUM_PROMPTS * OUTPUT_LEN
    rates = {name: tokens / statistics.median(t[1:]) for name, t in times.items()}
    ref = rates["base model, LoRA off"]
    print("| case | output tok/s (median of 3) | vs base |", file=out)
    print("| --- | --- | --- |", file=out)
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / ref:.2f}x |", file=out)
    return rates


def test_bench_lora_adapters_in_the_batch():
    rates = run()
    assert all(rate > 0 for rate in rates.values())


if __name__ == "__main__":
    # one torch thread: on a shared 2-core machine OpenMP's spin-waits between the many small
    # ops of a LoRA step swamp the figures
    torch.set_num_threads(1)
    run()
