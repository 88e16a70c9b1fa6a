"""Tiny PEFT adapters for the LoRA tests, built with peft itself, and transformers + peft greedy
outputs as the oracle (shared by the tests of this folder)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pagedllm import LLM, LoRARequest, SamplingParams

from model_factory import build_hf_model, hf_generate_greedy, save_tiny_checkpoint, tiny_hf_config

MAX_NEW = 8
# shorter than a block, across block boundaries, several blocks (block_size 4)
PROMPTS = [[5, 17, 99, 3], list(range(20, 39)), [7] * 9 + [11, 12, 13]]
# two adapters: different ranks, scalings (one rank-stabilized) and projections
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "beta": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["k_proj", "q_proj", "gate_proj", "up_proj"],
    ),
}


def save_peft_adapter(folder: Path, family: str, seed: int, **lora_kwargs) -> Path:
    """A random PEFT LoRA adapter for the tiny `family` model, saved by peft into `folder`."""
    from peft import LoraConfig, get_peft_model

    model = build_hf_model(tiny_hf_config(family), seed=3)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                # big enough that greedy tokens change, like a trained adapter's
                param.copy_(
                    torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1])
                )
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers (+ peft when `adapter`) greedy `generate`: MAX_NEW tokens per prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return hf_generate_greedy(model, prompts, MAX_NEW)


class LoRAWorld:
    """A tiny checkpoint of one family, two adapters for it and the oracle's outputs."""

    def __init__(self, root: Path, family: str) -> None:
        self.family = family
        self.base = save_tiny_checkpoint(root / "base", family, seed=3)
        self.requests = {
            name: LoRARequest(
                name, i + 1, str(save_peft_adapter(root / name, family, 10 + i, **kw))
            )
            for i, (name, kw) in enumerate(ADAPTERS.items())
        }
        self.expected: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}
        for name in (None, *self.requests):
            path = None if name is None else Path(self.requests[name].lora_path)
            for prompt, out in zip(PROMPTS, peft_greedy(self.base, path, PROMPTS)):
                self.expected[(name, tuple(prompt))] = out

    def llm(self, **kwargs) -> LLM:
        kwargs = {
            "enable_lora": True,
            "max_loras": 2,
            "max_lora_rank": 8,
            "device": "cpu",
            **kwargs,
        }
        return LLM(str(self.base), dtype="float32", block_size=4, **kwargs)

    def mixed_batch(self) -> tuple[list[dict], list[LoRARequest | None], list[tuple]]:
        """Every prompt under the base model and each adapter, interleaved in one batch."""
        prompts, loras, keys = [], [], []
        for prompt in PROMPTS:
            for name in (None, *self.requests):
                prompts.append({"prompt_token_ids": prompt})
                loras.append(None if name is None else self.requests[name])
                keys.append((name, tuple(prompt)))
        return prompts, loras, keys

    def check(self, outs, keys) -> None:
        for out, key in zip(outs, keys):
            assert out.finished
            got = out.outputs[0].token_ids
            assert got == self.expected[key], f"{self.family} adapter {key[0]} prompt {key[1][:5]}"


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
