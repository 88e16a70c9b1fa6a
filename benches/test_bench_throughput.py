"""End-to-end throughput of the built-in default model on CPU, side by side with `transformers`
generate on the same workload and weights (greedy, EOS ignored, equal-length random prompts).

Run: python -m pytest benches/test_bench_throughput.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cli.bench import random_prompts

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 16, 64, 32


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    return LLM(device="cpu", max_model_len=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(NUM_PROMPTS, INPUT_LEN, llm.engine.model_config.vocab_size, seed=0)


def test_bench_pagedllm_generate(benchmark, llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    outs = benchmark.pedantic(
        llm.generate, args=(batch, params), kwargs={"use_tqdm": False}, rounds=3, warmup_rounds=1
    )
    assert sum(len(o.outputs[0].token_ids) for o in outs) == NUM_PROMPTS * OUTPUT_LEN
    benchmark.extra_info["output_tokens"] = NUM_PROMPTS * OUTPUT_LEN


def test_bench_transformers_generate(benchmark, llm, prompts):
    from pagedllm.models.hf_export import to_transformers

    model = to_transformers(llm.engine.model, llm.engine.model_config)
    ids = torch.tensor(prompts)

    def run():
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=OUTPUT_LEN,
                min_new_tokens=OUTPUT_LEN,
                pad_token_id=0,
            )

    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    assert out.shape == (NUM_PROMPTS, INPUT_LEN + OUTPUT_LEN)
    benchmark.extra_info["output_tokens"] = NUM_PROMPTS * OUTPUT_LEN
