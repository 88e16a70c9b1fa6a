"""LoRA under tensor parallelism (2 CPU ranks): each rank holds its shard of every adapter (A
whole and B's output rows for q/k/v and gate/up, A's input columns and B whole for o and down)
and a mixed batch of two adapters and the base model gives one rank's greedy tokens, also with
the one KV head replicated on both ranks."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams

from lora_util import ADAPTERS, PROMPTS
from model_factory import build_hf_model, save_tiny_checkpoint, tiny_hf_config

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _adapter(folder, family: str, kv_heads: int, seed: int, **lora_kwargs) -> str:
    """A random PEFT adapter for the tiny model with `kv_heads` KV heads."""
    from peft import LoraConfig, get_peft_model

    model = build_hf_model(tiny_hf_config(family, num_key_value_heads=kv_heads), seed=3)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1])
                )
    peft_model.save_pretrained(folder)
    return str(folder)


def _outputs(base, requests, tp: int, max_loras: int = 2) -> list[list[int]]:
    llm = LLM(
        str(base),
        tensor_parallel_size=tp,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=8,
        device="cpu",
        cpu_threads=1,
        dtype="float32",
        block_size=4,
        num_gpu_blocks=64,
    )
    try:
        prompts, loras = [], []
        for prompt in PROMPTS:
            for request in (None, *requests):
                prompts.append({"prompt_token_ids": prompt})
                loras.append(request)
        outs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs]
    finally:
        llm.llm_engine.shutdown()


def _world(tmp_path, family: str, kv_heads: int):
    base = save_tiny_checkpoint(tmp_path / "base", family, num_key_value_heads=kv_heads, seed=3)
    # between them the two adapters adapt every projection
    requests = [
        LoRARequest(name, i + 1, _adapter(tmp_path / name, family, kv_heads, 10 + i, **kw))
        for i, (name, kw) in enumerate(ADAPTERS.items())
    ]
    return base, requests


@pytest.mark.parametrize(("family", "kv_heads"), [("llama", 2), ("qwen2", 1)])
def test_lora_under_two_ranks_gives_the_tokens_of_one(tmp_path, family, kv_heads):
    base, requests = _world(tmp_path, family, kv_heads)
    one = _outputs(base, requests, 1)
    two = _outputs(base, requests, 2)
    assert two == one
    # the adapters did change the tokens (else the test would prove nothing)
    base_rows, alpha_rows, beta_rows = one[0::3], one[1::3], one[2::3]
    assert alpha_rows != base_rows and beta_rows != base_rows


def test_adapters_swapped_through_one_slot_under_two_ranks_give_the_tokens_of_one(tmp_path):
    # max_loras=1: the adapters take turns in the one slot; the worker places each one where
    # rank 0 loaded it, evicting the other
    base, requests = _world(tmp_path, "llama", 2)
    assert _outputs(base, requests, 2, max_loras=1) == _outputs(base, requests, 1, max_loras=1)
