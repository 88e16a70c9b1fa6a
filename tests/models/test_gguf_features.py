"""The engine's features on a GGUF model (weights kept Q8_0): two tensor-parallel ranks, a GGUF
draft model, preemption, data-parallel replicas and the KV offload tier each give the greedy
tokens of the plain engine on the same file."""

from __future__ import annotations

import pytest
from test_gguf_loader import Q, write_gguf

from pagedllm import LLM, SamplingParams

from model_factory import save_tiny_checkpoint

# token ids of the tiny file's 96-entry vocabulary: shorter than a block, several blocks
PROMPTS = [[5, 17, 60, 3], list(range(20, 39)), [7] * 9 + [11, 12, 13]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(folder / "m.gguf", qtype=Q.Q8_0)
    # the file carries no tokenizer; the prompts are token ids, the tokenizer only decodes
    tokenizer = save_tiny_checkpoint(folder / "tok", "llama")
    return {"model": str(folder / "m.gguf"), "tokenizer": str(tokenizer)}


def _greedy(model: dict, **engine) -> list[list[int]]:
    llm = LLM(block_size=4, cpu_threads=1, **model, **engine)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    return _greedy(model)


def test_two_ranks_generate_the_tokens_of_one(model, expected):
    assert _greedy(model, tensor_parallel_size=2) == expected


def test_a_gguf_draft_model_keeps_the_greedy_tokens(model, expected):
    draft = {"method": "draft_model", "model": model["model"], "num_speculative_tokens": 3}
    assert _greedy(model, speculative_config=draft) == expected


def test_preemption_keeps_the_greedy_tokens(model, expected):
    # 12 blocks of 4 tokens: the three sequences (4 + 8 + 6 blocks at the end) cannot all stay
    llm = LLM(block_size=4, cpu_threads=1, num_gpu_blocks=12, max_model_len=32, **model)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_data_parallel_replicas_generate_the_tokens_of_one(model, expected):
    assert _greedy(model, data_parallel_size=2) == expected


def test_the_offload_tier_serves_an_evicted_prefix(model, expected):
    llm = LLM(
        block_size=4,
        cpu_threads=1,
        num_gpu_blocks=12,
        max_model_len=32,
        kv_offloading_size=0.01,
        **model,
    )
    first = [{"prompt_token_ids": PROMPTS[1]}]
    llm.generate(first, PARAMS, use_tqdm=False)
    # two other prompts push the first one's blocks out of the device cache
    for shift in (30, 50):
        other = [{"prompt_token_ids": [p + shift for p in PROMPTS[1]]}]
        llm.generate(other, PARAMS, use_tqdm=False)
    again = llm.generate(first, PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == expected[1]
    assert llm.llm_engine.scheduler.get_stats()["kv_offload_loaded_blocks"] > 0


def test_a_lora_adapter_on_quantized_weights_gives_peft_on_the_dequantized_model(model, tmp_path):
    import math

    import torch
    from peft import LoraConfig, get_peft_model

    from pagedllm import LoRARequest
    from pagedllm.models.hf_export import to_transformers
    from pagedllm.models.loader import load_model

    from model_factory import hf_generate_greedy

    # the oracle: transformers over the file's weights dequantized, plus the adapter by peft
    hf = to_transformers(load_model(model["model"], device="cpu")).eval()
    base = hf_generate_greedy(hf, PROMPTS, PARAMS.max_tokens)  # before peft wraps it in place
    targets = ["q_proj", "v_proj", "o_proj", "down_proj", "gate_proj"]
    peft_model = get_peft_model(
        hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                # big enough to change greedy tokens, like a trained adapter's
                scale = math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=generator) / scale)
    peft_model.save_pretrained(tmp_path / "adapter")
    want = hf_generate_greedy(peft_model.eval(), PROMPTS, PARAMS.max_tokens)

    llm = LLM(block_size=4, cpu_threads=1, enable_lora=True, max_lora_rank=8, **model)
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, PARAMS, lora_request=adapter, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert want != base  # the adapter matters
