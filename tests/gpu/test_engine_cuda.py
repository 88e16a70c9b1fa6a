"""The engine on CUDA against transformers' greedy `generate` on CUDA, for the Llama, Qwen2 and
Qwen3 test models in float32 and bfloat16: the Triton kernels, sampling on the device, pinned
copies and (unless `enforce_eager`) the decode CUDA graphs, end to end.

float32 must give the same tokens. bfloat16 may part ways where two tokens are nearly tied (the
two implementations round differently), so there it is vLLM's rule: the tokens agree up to the
first difference, and there transformers' token is among our 5 most likely."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from model_factory import hf_generate_greedy, save_tiny_checkpoint

MAX_NEW = 12
# shorter than a block, across a block boundary, several blocks
PROMPTS = [[5, 17, 99, 3], list(range(20, 41)), [7] * 9 + [11, 12, 13], list(range(100, 150))]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOP = 5


def hf_greedy(folder, dtype: torch.dtype, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    return hf_generate_greedy(model, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def generate(folder, dtype: str, **engine_kwargs):
    engine_kwargs.setdefault("num_gpu_blocks", 256)  # tests share the device (pytest-xdist)
    llm = LLM(
        str(folder), dtype=dtype, device="cuda", block_size=16, max_model_len=256, **engine_kwargs
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def assert_close_to_reference(completions, expected, dtype: str) -> None:
    for prompt, completion, ref in zip(PROMPTS, completions, expected):
        ours = list(completion.token_ids)
        if dtype == "float32":
            assert ours == ref, f"prompt {prompt[:6]}..."
            continue
        for pos, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                top = completion.logprobs[pos]
                assert b in top, f"prompt {prompt[:6]}...: at {pos} {b} not in our top {TOP}"
                break


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_greedy_matches_transformers_on_cuda(family, dtype, enforce_eager):
    expected = hf_greedy(family, DTYPES[dtype], PROMPTS)
    llm, completions = generate(family, dtype, enforce_eager=enforce_eager)
    assert llm.llm_engine.device.type == "cuda"
    assert_close_to_reference(completions, expected, dtype)


def test_cuda_cache_is_sized_by_profiling_within_the_memory_budget(tmp_path):
    # one test only, on one family: its cache takes whatever the budget leaves, and the budget
    # counts other processes' memory (pytest-xdist workers), so it asks for what is in use now
    # plus 4 GiB rather than a share of the whole device
    folder = save_tiny_checkpoint(tmp_path, "qwen3", seed=3)
    free, total = torch.cuda.mem_get_info()
    utilization = min(0.9, (total - free + (4 << 30)) / total)
    llm, completions = generate(
        folder, "float32", num_gpu_blocks=None, gpu_memory_utilization=utilization
    )
    cache = llm.llm_engine.cache_engine.kv_cache
    assert llm.llm_engine.cache_engine.num_gpu_blocks > 256
    assert cache.numel() * cache.element_size() <= 4 << 30
    assert_close_to_reference(completions, hf_greedy(folder, torch.float32, PROMPTS), "float32")


def test_blocks_all_return_after_a_cuda_run(family):
    llm, _ = generate(family, "bfloat16")
    stats = llm.llm_engine.scheduler.get_stats()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
