"""Our paged models against transformers (the outside oracle), float32 on CPU.

Two sequences are packed in every step, over random non-contiguous block tables: a prefill of
both prompts, several single-token decode steps, then a multi-token chunk over the cached prefix.
After each step the logits of every new token must equal transformers' logits at the same
positions of a full, uncached forward over the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.models import load_model

from model_factory import FAMILIES, PagedRunner, save_tiny_checkpoint

TOLERANCE = dict(rtol=2e-5, atol=2e-5)
PROMPTS = {"a": [5, 17, 99, 3, 250, 7, 8, 42, 11, 64, 300], "b": [2, 210, 33, 4, 19]}
DECODE_STEPS = 3
CHUNKS = {"a": [12, 13, 14, 15, 16, 17], "b": [101, 102, 103]}


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_step_matches(
    hf_model, runner: PagedRunner, step_logits: dict[str, torch.Tensor]
) -> None:
    for name, logits in step_logits.items():
        tokens = runner.tokens(name)
        expected = hf_logits(hf_model, tokens)[len(tokens) - logits.shape[0] :]
        torch.testing.assert_close(logits, expected, **TOLERANCE)


def run_prefill_decode_chunk(folder, *, pack_for_cpu: bool = False) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder, dtype="float32", device="cpu", pack_for_cpu=pack_for_cpu)
    runner = PagedRunner(model, num_blocks=32, block_size=4, seed=1)
    assert_step_matches(hf_model, runner, runner.step(PROMPTS))
    for step in range(DECODE_STEPS):
        decode = {"a": [20 + step], "b": [30 + step]}
        assert_step_matches(hf_model, runner, runner.step(decode))
    assert_step_matches(hf_model, runner, runner.step(CHUNKS))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_through_prefill_decode_and_chunk(tmp_path, family):
    folder = save_tiny_checkpoint(tmp_path, family, tokenizer=None, seed=3)
    run_prefill_decode_chunk(folder)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tied_embedding_logits_match_transformers(tmp_path, family):
    folder = save_tiny_checkpoint(
        tmp_path, family, tie_word_embeddings=True, tokenizer=None, seed=4
    )
    run_prefill_decode_chunk(folder)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "linear", "factor": 4.0}
    folder = save_tiny_checkpoint(tmp_path, "llama", tokenizer=None, seed=5, rope_scaling=rope)
    run_prefill_decode_chunk(folder)


def test_attention_bias_llama_matches_transformers(tmp_path):
    folder = save_tiny_checkpoint(
        tmp_path, "llama", tokenizer=None, seed=6, attention_bias=True, mlp_bias=True
    )
    run_prefill_decode_chunk(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_packed_for_the_cpu_kernel_match_transformers(tmp_path, family):
    # what the engine runs on the CPU: every projection and the LM head through the Rust
    # kernel's panels (kernels/cpu_linear.py), biases included
    folder = save_tiny_checkpoint(
        tmp_path, family, tokenizer=None, seed=7, attention_bias=True, mlp_bias=True
    )
    run_prefill_decode_chunk(folder, pack_for_cpu=True)
