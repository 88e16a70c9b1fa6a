"""bfloat16 on the CPU end to end, layer by layer (`enforce_eager`: the one-call decoder's own
equality with this path is tests/models/test_cpu_forward.py's): every attention and rotary call
of a greedy generation goes through the Rust kernels (none falls back to the torch reference),
and the tokens equal those of the same generation forced onto the torch reference path."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, _core
from pagedllm.attention import cpu_attention, cpu_rotary, paged

from model_factory import save_tiny_checkpoint

# a prompt inside one block, one across several (block_size 4), one chunked (long_prefill)
PROMPTS = [[5, 17, 99], list(range(20, 41)), list(range(100, 140))]
MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def _greedy(folder) -> list[list[int]]:
    llm = LLM(
        str(folder),
        dtype="bfloat16",
        device="cpu",
        enforce_eager=True,  # layer by layer: the kernels counted below
        block_size=4,
        max_num_batched_tokens=16,  # the 40-token prompt prefills in chunks beside decodes
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_bf16_greedy_generation_runs_on_the_rust_kernels_and_matches_the_torch_path(
    checkpoint, monkeypatch
):
    with monkeypatch.context() as m:
        m.setattr(cpu_attention, "supports", lambda *a: False)
        m.setattr(cpu_rotary, "supports", lambda *a: False)
        reference = _greedy(checkpoint)

    calls = {"attention": 0, "rotary": 0}

    def counted(name, kernel):
        def call(*args):
            calls[name] += 1
            return kernel(*args)

        return call

    def no_fallback(*args):
        raise AssertionError("bfloat16 attention fell back to the torch reference")

    monkeypatch.setattr(paged, "_paged_attention_torch", no_fallback)
    monkeypatch.setattr(
        _core, "cpu_paged_attention", counted("attention", _core.cpu_paged_attention)
    )
    monkeypatch.setattr(_core, "cpu_rotary_in_place", counted("rotary", _core.cpu_rotary_in_place))
    tokens = _greedy(checkpoint)
    assert calls["attention"] > 0 and calls["rotary"] > 0
    assert all(len(t) == MAX_NEW for t in tokens)
    assert tokens == reference
