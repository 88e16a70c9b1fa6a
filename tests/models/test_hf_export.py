"""Export to transformers (`pagedllm.models.hf_export`): same logits, same greedy text, same
tensors.

transformers is the outside oracle here: a wrong split of the fused q/k/v or gate/up weights, a
wrong rope/eps/bias flag or a lost tie shows up as different logits or different tensors.
CPU, float32.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import pagedllm
from pagedllm.models import (
    ModelConfig,
    RopeConfig,
    build_tiny_random,
    load_model,
    tiny_random_config,
)
from pagedllm.models.config import parse_model_config
from pagedllm.models.hf_export import (
    config_json,
    hf_config,
    hf_state_dict,
    save_checkpoint,
    to_transformers,
)
from pagedllm.models.tiny_random import save_byte_tokenizer
from pagedllm.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, ByteTokenizer, load_tokenizer

from model_factory import PagedRunner, paged_greedy, save_tiny_checkpoint

TOLERANCE = dict(rtol=2e-5, atol=2e-5)
PROMPTS = [
    [BYTE_BOS_ID, *b"The quick brown fox"],
    [BYTE_BOS_ID, *b"paged attention, 42"],
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_random()


@pytest.fixture(scope="module")
def tiny_hf(tiny):
    return to_transformers(tiny)


def test_exported_model_is_eval_same_device_dtype_and_shares_weights(tiny, tiny_hf):
    assert not tiny_hf.training
    assert tiny_hf.dtype == torch.float32 and tiny_hf.device.type == "cpu"
    assert not any(p.requires_grad for p in tiny_hf.parameters())
    # q_proj is the first rows of our fused qkv_proj: a view, not a copy
    ours = tiny.model.layers[0].self_attn.qkv_proj.weight
    theirs = tiny_hf.model.layers[0].self_attn.q_proj.weight
    assert theirs.data_ptr() == ours.data_ptr()
    assert tiny_hf.generation_config.eos_token_id == BYTE_EOS_ID


def test_tiny_random_logits_match_transformers(tiny, tiny_hf):
    runner = PagedRunner(tiny, num_blocks=16, block_size=4, seed=2)
    # both prompts packed in one prefill, then one decode step each, over random block tables
    step = runner.step({"a": PROMPTS[0], "b": PROMPTS[1]})
    step2 = runner.step({"a": [65], "b": [66]})
    with torch.no_grad():
        for name in ("a", "b"):
            tokens = runner.tokens(name)
            expected = tiny_hf(torch.tensor([tokens])).logits[0].float()
            torch.testing.assert_close(step[name], expected[:-1], **TOLERANCE)
            torch.testing.assert_close(step2[name], expected[-1:], **TOLERANCE)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tiny_random_greedy_generate_matches_paged_greedy(tiny, tiny_hf, prompt):
    ours = paged_greedy(tiny, prompt, NEW_TOKENS)
    # transformers stops at EOS, our helper does not: compare up to (and including) the first EOS
    expected = ours[: ours.index(BYTE_EOS_ID) + 1] if BYTE_EOS_ID in ours else ours
    with torch.no_grad():
        out = tiny_hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    assert out[0, : len(prompt)].tolist() == prompt
    assert out[0, len(prompt) :].tolist() == expected
    assert len(expected) >= NEW_TOKENS // 2  # the comparison covers a real continuation


def test_save_checkpoint_round_trips_through_our_loader_and_transformers(tiny, tmp_path):
    folder = save_checkpoint(tiny, tmp_path / "tiny")
    assert {p.name for p in folder.iterdir()} == {
        "config.json",
        "model.safetensors",
        "generation_config.json",
    }
    loaded = load_model(folder, dtype="float32", device="cpu")
    assert dataclasses.replace(loaded.config, path=None) == tiny.config
    ours, back = tiny.state_dict(), loaded.state_dict()
    assert ours.keys() == back.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert hf.generation_config.eos_token_id == BYTE_EOS_ID
    expected = hf_state_dict(tiny)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3", {}),
        ("qwen2", {}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("llama", {"mlp_bias": True}),
    ],
)
def test_loaded_checkpoint_exports_to_transformers_own_weights(tmp_path, family, overrides):
    folder = save_tiny_checkpoint(tmp_path, family, tokenizer=None, seed=7, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder, dtype="float32", device="cpu")
    exported = to_transformers(ours)
    assert type(exported) is type(reference)
    ref_state, exp_state = reference.state_dict(), exported.state_dict()
    assert exp_state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(exp_state[name], tensor), name
    # the config carries the same architecture-relevant fields as the checkpoint's own
    written = json.loads((Path(folder) / "config.json").read_text())
    produced = json.loads(hf_config(ours.config).to_json_string())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "architectures",
    ):
        assert produced.get(key) == written.get(key), key
    tokens = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(tokens).logits, reference(tokens).logits, rtol=0, atol=0
        )


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"rope": RopeConfig(theta=500000.0, rope_type="linear", factor=4.0)},
        {
            "rope": RopeConfig(
                theta=500000.0,
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            )
        },
        {
            "qkv_bias": True,
            "o_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
            "eos_token_ids": (257, 7, 9),
            "rms_norm_eps": 1e-6,
        },
        {
            "architecture": "Qwen2ForCausalLM",
            "family": "qwen2",
            "qkv_bias": True,
            "checkpoint_dtype": "bfloat16",
        },
        {"architecture": "Qwen3ForCausalLM", "family": "qwen3", "qk_norm": True, "head_dim": 48},
    ],
)
def test_hf_config_parses_back_to_the_same_model_config(changes):
    cfg = dataclasses.replace(tiny_random_config(), **changes)
    raw = json.loads(hf_config(cfg).to_json_string())
    generation = {
        "eos_token_id": list(cfg.eos_token_ids)
    }  # several eos ids live in generation_config
    assert parse_model_config(raw, generation) == cfg


@pytest.mark.parametrize(
    "changes",
    [
        {"architecture": "Qwen2ForCausalLM", "family": "qwen2", "qkv_bias": False},
        {"qkv_bias": True, "o_bias": False},
        {"qk_norm": True},
        {"architecture": "Qwen3ForCausalLM", "family": "qwen3", "qk_norm": True, "mlp_bias": True},
        {"layer_windows": (16, 16)},
        {"architecture": "Gemma2ForCausalLM", "family": "gemma2"},
        {"rope": RopeConfig(rope_type="yarn", factor=4.0)},
    ],
)
def test_hf_config_rejects_what_transformers_cannot_express(changes):
    cfg: ModelConfig = dataclasses.replace(tiny_random_config(), **changes)
    with pytest.raises(ValueError, match="cannot export"):
        hf_config(cfg)


def test_importing_models_does_not_import_transformers():
    # a fresh interpreter: this test process has imported transformers already
    code = (
        "import sys, pagedllm.models; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    pagedllm_root = Path(pagedllm.__file__).resolve().parent.parent  # same package as the tests use
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(pagedllm_root), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def test_missing_transformers_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match="optional dependency 'transformers'"):
        hf_config(tiny_random_config())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_config_json_reads_back_as_what_transformers_writes(family):
    cfg = tiny_random_config(family)
    written = json.loads(hf_config(cfg).to_json_string())
    assert parse_model_config(config_json(cfg)) == parse_model_config(written) == cfg


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_saved_checkpoint_of_each_family_gives_transformers_our_logits(family, tmp_path):
    ours = build_tiny_random(tiny_random_config(family), seed=5)
    folder = save_checkpoint(ours, tmp_path / family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.config.architectures == [ours.config.architecture]
    with torch.no_grad():
        expected = to_transformers(ours)(torch.tensor([PROMPTS[0]])).logits
        torch.testing.assert_close(hf(torch.tensor([PROMPTS[0]])).logits, expected, **TOLERANCE)


def test_save_checkpoint_with_fewer_layers_keeps_the_first_ones(tiny, tmp_path):
    folder = save_checkpoint(tiny, tmp_path / "draft", num_layers=1)
    draft = load_model(folder, dtype="float32", device="cpu")
    assert draft.config.num_layers == 1
    assert draft.config.vocab_size == tiny.config.vocab_size
    full = tiny.state_dict()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, full[name]), name


def test_save_checkpoint_refuses_more_layers_than_the_model_has(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 4\], got 5"):
        save_checkpoint(tiny, tmp_path / "x", num_layers=5)


# ---- export_tiny_random (`pagedllm export-tiny`) --------------------------------------------


def test_exported_byte_tokenizer_encodes_and_decodes_as_the_built_in_one(tmp_path):
    save_byte_tokenizer(tmp_path)
    theirs, ours = load_tokenizer(tmp_path), ByteTokenizer()
    for text in ["Hello, my name is", "Größe — naïve café\n\t 123", ""]:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (BYTE_BOS_ID, BYTE_EOS_ID)


def test_tiny_random_config_refuses_an_unknown_family():
    with pytest.raises(ValueError, match=r"family must be one of \['llama', 'qwen2', 'qwen3'\]"):
        tiny_random_config("mistral")
