"""RoPE scalings that extend the context (yarn, dynamic NTK, longrope) against transformers:
the logits of one unchunked forward longer than the original context equal transformers' at
every position, those beyond the original length included (the engine's tables are static,
computed for the longest context the scaling covers: `models/rope.py`); max_model_len is allowed
up to what the scaling covers and refused beyond it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.engine.kv_sizing import resolve_max_model_len
from pagedllm.models import load_model

from model_factory import PagedRunner, save_tiny_checkpoint

ORIGINAL = 32  # the "pretraining" context of the scaled configs
HALF_DIM = 8  # llama's tiny head size is 16: 8 rotated pairs


def _forward_matches_transformers(folder, length: int) -> None:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder, dtype="float32", device="cpu")
    tokens = [(i * 29 + 7) % 300 + 2 for i in range(length)]
    runner = PagedRunner(model, num_blocks=-(-length // 4), block_size=4, seed=2)
    got = runner.step({"s": tokens})["s"]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"beta_fast": 16.0, "beta_slow": 2.0},
        {"mscale": 1.0, "mscale_all_dim": 0.5},
        {"attention_factor": 1.3, "truncate": False},
    ],
    ids=["defaults", "betas", "mscale", "attention_factor"],
)
def test_yarn_logits_match_transformers_beyond_the_original_length(tmp_path, extra):
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 10000.0,
        **extra,
    }
    folder = save_tiny_checkpoint(
        tmp_path, "llama", tokenizer=None, seed=5, rope_scaling=rope, max_position_embeddings=128
    )
    _forward_matches_transformers(folder, 100)


def test_dynamic_ntk_logits_match_transformers_at_the_longest_covered_length(tmp_path):
    # transformers recomputes the base from the forward's length; the engine's static base is
    # the one of factor x max_position_embeddings: equal for a forward of exactly that length
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    folder = save_tiny_checkpoint(
        tmp_path, "llama", tokenizer=None, seed=6, rope_scaling=rope, max_position_embeddings=48
    )
    _forward_matches_transformers(folder, 96)


def test_longrope_logits_match_transformers_with_the_long_factors(tmp_path):
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HALF_DIM)],
        "long_factor": [1.5 + 0.5 * i for i in range(HALF_DIM)],
        "original_max_position_embeddings": ORIGINAL,
        "rope_theta": 10000.0,
    }
    folder = save_tiny_checkpoint(
        tmp_path, "llama", tokenizer=None, seed=7, rope_scaling=rope, max_position_embeddings=128
    )
    _forward_matches_transformers(folder, 80)


def _config(tmp_path, rope, max_positions):
    folder = save_tiny_checkpoint(
        tmp_path,
        "llama",
        tokenizer=None,
        rope_scaling=rope,
        max_position_embeddings=max_positions,
    )
    return load_model(folder, dtype="float32", device="cpu").config


def test_max_model_len_may_reach_what_yarn_covers_and_no_further(tmp_path):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = _config(tmp_path, rope, 64)
    assert resolve_max_model_len(SimpleNamespace(max_model_len=256), cfg) == 256
    with pytest.raises(ValueError, match=r"max_model_len=257 exceeds what the model's RoPE covers"):
        resolve_max_model_len(SimpleNamespace(max_model_len=257), cfg)


def test_max_model_len_beyond_an_unscaled_context_names_the_missing_scaling(tmp_path):
    cfg = _config(tmp_path, {"rope_type": "default"}, 64)
    with pytest.raises(ValueError, match=r"rope_type 'default'.*needs a rope_scaling"):
        resolve_max_model_len(SimpleNamespace(max_model_len=65), cfg)
