"""Greedy outputs with LoRA adapters equal transformers + peft, for requests of two adapters and
of the base model mixed in one batch: Llama, Qwen2 and Qwen3, every strategy, prefix caching
on, under preemption."""

from __future__ import annotations

import pytest

from lora_util import PARAMS, PROMPTS


def assert_blocks_free(llm) -> None:
    stats = llm.engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]


def test_adapters_change_the_output(world):
    # the oracle itself: otherwise parity below would prove nothing about the deltas
    for name in world.requests:
        changed = [
            world.expected[(name, tuple(p))] != world.expected[(None, tuple(p))] for p in PROMPTS
        ]
        assert any(changed), f"{world.family}: adapter {name} changes no greedy output"


@pytest.mark.parametrize("scheduling", ["unified", "prefill_first", "chunked_prefill"])
def test_mixed_batch_matches_peft_under_each_strategy(world, scheduling):
    llm = world.llm(scheduling=scheduling, enable_prefix_caching=True)
    prompts, loras, keys = world.mixed_batch()
    outs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    world.check(outs, keys)
    assert [out.lora_request for out in outs] == loras
    # again: every prompt's blocks are cached now, each under its own adapter
    again = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    world.check(again, keys)
    assert all(
        out.num_cached_tokens > 0
        for out, p in zip(again, prompts)
        if len(p["prompt_token_ids"]) > 4
    )
    assert_blocks_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_batch_matches_peft_under_preemption(llama_world, mode):
    # 8 blocks of 4 hold two of the longest sequences (19 + 8 tokens), not all nine requests
    llm = llama_world.llm(
        preemption_mode=mode, num_gpu_blocks=8, max_model_len=28, max_num_batched_tokens=32
    )
    prompts, loras, keys = llama_world.mixed_batch()
    outs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    llama_world.check(outs, keys)
    assert llm.engine.scheduler.get_stats()["num_preemptions"] > 0
    assert_blocks_free(llm)


def test_chat_runs_each_conversation_with_its_adapter(llama_world):
    llm = llama_world.llm()
    alpha = llama_world.requests["alpha"]
    chat = [{"role": "user", "content": "hello world"}]
    outs = llm.chat([chat, chat], PARAMS, lora_request=[alpha, None], use_tqdm=False)
    prompt = {"prompt_token_ids": outs[0].prompt_token_ids}
    same = llm.generate([prompt, prompt], PARAMS, lora_request=[alpha, None], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in same]
    assert outs[0].lora_request == alpha and outs[1].lora_request is None


def test_the_triton_kernels_drive_the_model(llama_world, monkeypatch):
    # On CUDA the engine picks the kernels itself; without a GPU they run on the CPU tensors
    # under the Triton interpreter (conftest.py), here forced in place of the torch reference.
    import torch

    from pagedllm.kernels.lora import lora_expand, lora_shrink
    from pagedllm.lora.layers import LoRAState

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(LoRAState, "ops", lambda self, x: (lora_shrink, lora_expand))
    llm = llama_world.llm(device=device)
    loras = [llama_world.requests["alpha"], None, llama_world.requests["beta"]]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    names = [None if r is None else r.lora_name for r in loras]
    llama_world.check(outs, [(n, tuple(p)) for n, p in zip(names, PROMPTS)])
