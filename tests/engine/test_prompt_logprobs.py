"""`SamplingParams.prompt_logprobs` through the engine equal the log-softmax of a transformers
forward over the prompt (the outside oracle): whole, in chunks, after a prefix-cache hit and
after a preemption."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

from model_factory import save_tiny_checkpoint

TOP = 3
PROMPT = [5, 17, 99, 3, 250, 7, 8, 42, 11, 64, 300, 2, 210, 33, 4, 19, 101, 102, 103, 20, 21]
TOLERANCE = dict(rel=2e-4, abs=2e-4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_checkpoint(tmp_path_factory.mktemp("plp"), "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(dim=-1)
    return folder, logprobs


def prompt_logprobs(folder, prompt=PROMPT, *, first=None, **engine_kwargs):
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4, **engine_kwargs)
    if first is not None:  # an earlier request whose prompt fills the prefix cache
        llm.generate({"prompt_token_ids": first}, SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return out


def assert_equal_to_reference(entries, expected: torch.Tensor) -> None:
    assert len(entries) == len(PROMPT)
    assert entries[0] is None
    for i in range(1, len(PROMPT)):
        row = expected[i - 1]
        token = PROMPT[i]
        entry = entries[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), **TOLERANCE)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(TOP)
        for rank, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[tid].logprob == pytest.approx(lp, **TOLERANCE)
            assert entry[tid].rank == rank
        assert set(entry) == {token, *top.indices.tolist()}


def test_prompt_logprobs_equal_transformers_log_softmax(checkpoint):
    folder, expected = checkpoint
    out = prompt_logprobs(folder)
    assert_equal_to_reference(out.prompt_logprobs, expected)
    assert all(e[t].decoded_token is not None for e, t in zip(out.prompt_logprobs[1:], PROMPT[1:]))


@pytest.mark.parametrize("scheduling", ["unified", "chunked_prefill"])
def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks(checkpoint, scheduling):
    folder, expected = checkpoint
    out = prompt_logprobs(folder, scheduling=scheduling, max_num_batched_tokens=8)
    assert_equal_to_reference(out.prompt_logprobs, expected)


def test_prompt_logprobs_request_skips_prefix_cache_hits(checkpoint):
    folder, expected = checkpoint
    out = prompt_logprobs(folder, first=PROMPT)
    assert out.num_cached_tokens == 0
    assert_equal_to_reference(out.prompt_logprobs, expected)


def test_prompt_logprobs_survive_preemption_by_recompute(checkpoint):
    folder, expected = checkpoint
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_gpu_blocks=9,
        max_model_len=32,
        preemption_mode="recompute",
        enable_prefix_caching=False,
    )
    asking = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)
    other = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:10]}],
        [asking, other],
        use_tqdm=False,
    )
    assert llm.engine.scheduler.get_stats()["num_preemptions"] > 0
    assert_equal_to_reference(outs[0].prompt_logprobs, expected)
    assert outs[1].prompt_logprobs is None


def test_prompt_logprobs_zero_gives_only_the_prompt_tokens(checkpoint):
    folder, _ = checkpoint
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in PROMPT[1:]]


def test_requests_without_prompt_logprobs_get_none(checkpoint):
    folder, _ = checkpoint
    llm = LLM(str(folder), dtype="float32", device="cpu", block_size=4)
    (out,) = llm.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert out.prompt_logprobs is None
