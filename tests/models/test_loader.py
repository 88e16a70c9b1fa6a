"""Checkpoint loading: what loads, and the clear errors (naming file or field) for what does not."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.models import (
    CheckpointError,
    CheckpointNotFoundError,
    load_model,
    load_model_config,
    loader,
    resolve_dtype,
)
from pagedllm.models.config import parse_model_config

from model_factory import save_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tokenizer=None)


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    return shutil.copytree(llama_dir, tmp_path / "ckpt")


@pytest.fixture
def no_materialize(monkeypatch):
    """Fail loudly if loading reaches the weight allocation: errors must come before it."""

    def forbidden(*args, **kwargs):
        raise AssertionError("weights were materialized before the checkpoint was validated")

    monkeypatch.setattr(loader, "_materialize", forbidden)


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_folder_names_the_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere", device="cpu")


def test_missing_config_json_names_the_file(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        load_model(llama_copy, device="cpu")


def test_malformed_config_json_names_the_file(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json.*malformed JSON"):
        load_model(llama_copy, device="cpu")


def test_missing_required_field_is_named(llama_copy):
    edit_config(llama_copy, hidden_size=None)
    with pytest.raises(CheckpointError, match="missing required field 'hidden_size'"):
        load_model_config(llama_copy)


def test_unsupported_architecture_lists_supported_ones(llama_copy):
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        CheckpointError,
        match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_model_config(llama_copy)


def test_model_type_is_used_when_architectures_is_absent(llama_copy):
    edit_config(llama_copy, architectures=None)
    assert load_model_config(llama_copy).architecture == "LlamaForCausalLM"


def test_unsupported_rope_type_names_the_field(llama_copy):
    edit_config(
        llama_copy,
        rope_parameters={"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(CheckpointError, match=r"rope_parameters\.rope_type' = 'proportional'"):
        load_model_config(llama_copy)


def test_unsupported_activation_names_the_field(llama_copy):
    edit_config(llama_copy, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="hidden_act"):
        load_model_config(llama_copy)


def test_legacy_rope_scaling_dialect_parses_llama3():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    rope = parse_model_config(raw).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)


def test_no_safetensors_file_is_reported(llama_copy, no_materialize):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors"):
        load_model(llama_copy, device="cpu")


def test_missing_tensor_is_named(llama_copy, no_materialize):
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(llama_copy, device="cpu")


def test_shape_mismatch_is_named(llama_copy, no_materialize):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    rewrite_weights(llama_copy, shrink)
    with pytest.raises(
        CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[8, 64\]"
    ):
        load_model(llama_copy, device="cpu")


def test_untied_checkpoint_without_lm_head_names_it(llama_copy, no_materialize):
    rewrite_weights(llama_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        load_model(llama_copy, device="cpu")


def test_index_naming_a_missing_shard_is_reported(tmp_path, no_materialize):
    folder = save_tiny_checkpoint(tmp_path, "qwen2", tokenizer=None, max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointNotFoundError, match=shard.name):
        load_model(folder, device="cpu")


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path):
    single = load_model(
        save_tiny_checkpoint(tmp_path / "one", "qwen2", tokenizer=None, seed=9), device="cpu"
    )
    sharded_dir = save_tiny_checkpoint(
        tmp_path / "many", "qwen2", tokenizer=None, seed=9, max_shard_size="40KB"
    )
    assert len(list(sharded_dir.glob("model-*.safetensors"))) > 1
    sharded = load_model(sharded_dir, device="cpu")
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_tied_embeddings_share_the_output_head(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True, tokenizer=None)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = load_model(folder, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtype_auto_is_float32_on_cpu(llama_dir):
    model = load_model(llama_dir, dtype="auto", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_explicit_dtype_converts_every_weight(llama_dir):
    model = load_model(llama_dir, dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_unknown_dtype_is_rejected(llama_dir):
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(llama_dir, dtype="int8", device="cpu")


def test_loaded_model_has_no_gradients_and_is_in_eval_mode(llama_dir):
    model = load_model(llama_dir, device="cpu")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_model_config_describes_the_checkpoint(llama_dir):
    cfg = load_model_config(llama_dir)
    shape = (
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.vocab_size,
    )
    assert shape == (2, 4, 2, 16, 64, 320)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (0, (1,), 256)


def test_generation_config_eos_list_wins(llama_copy):
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 9]}))
    cfg = load_model_config(llama_copy)
    assert (cfg.eos_token_ids, cfg.eos_token_id) == ((1, 7, 9), 1)


@pytest.mark.parametrize(
    "saved, expected",
    [
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_dtype_auto_on_gpu_follows_the_checkpoint_in_half_precision(llama_copy, saved, expected):
    edit_config(llama_copy, torch_dtype=saved, dtype=None)
    cfg = load_model_config(llama_copy)
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == expected


def test_loading_a_model_leaves_torch_dynamo_unimported(llama_dir):
    # building the model on the meta device must not run torch ops there: they import
    # torch._dynamo, seconds of every start-up (a fresh interpreter, as a server starts)
    code = (
        "import sys; from pagedllm.models.loader import load_model; "
        f"load_model({str(llama_dir)!r}, pack_for_cpu=True); "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False"
