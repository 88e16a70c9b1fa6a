"""GGUF files made here with `gguf.GGUFWriter` (a tiny Llama / Qwen3): metadata -> ModelConfig,
tensors -> the decoder's parameters (Q/K rows as llama.cpp's converter permutes them, quantized
weights kept in their type), and a clear GGUFError for each kind of bad file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.checkpoint.gguf_reader import GGUFFile
from pagedllm.models.gguf import GGUFError, read_gguf_config
from pagedllm.models.gguf.weights import gguf_tensor_name
from pagedllm.models.loader import expected_shapes, load_model

Q = gguf.GGMLQuantizationType
SHAPE = dict(layers=2, hidden=64, inter=128, heads=4, kv_heads=2, vocab=96)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (the rows of Q and K)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _hf_tensors(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape).astype(np.float32) * 0.2
        for name, shape in expected_shapes(cfg).items()
    }


def write_gguf(path, *, arch="llama", qtype=Q.F32, tied=True, heads=None, drop=(), **meta):
    """A tiny model of `arch` as a GGUF file; returns the Hugging Face tensors it holds (before
    quantization). `heads` overrides the head count written in the metadata only."""
    s = SHAPE
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(heads or s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in meta.items():
        writer.add_uint32(key, value)
    cfg = _config(arch, tied)
    tensors = _hf_tensors(cfg)
    for name, value in tensors.items():
        gguf_name = gguf_tensor_name(name)
        if gguf_name in drop:
            continue
        stored = value
        if arch == "llama" and ".q_proj." in name:
            stored = _llama_cpp_permute(value, s["heads"])
        elif arch == "llama" and ".k_proj." in name:
            stored = _llama_cpp_permute(value, s["kv_heads"])
        if stored.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(gguf_name, _stored_bytes(stored, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def _stored_bytes(value: np.ndarray, qtype) -> np.ndarray:
    if qtype in (Q.Q8_0, Q.Q4_0):
        return gguf.quants.quantize(value, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]  # a type gguf-py cannot quantize: zero blocks
    return np.zeros((value.shape[0], value.shape[1] // block * size), dtype=np.uint8)


def _config(arch: str, tied: bool):
    from pagedllm.models.config import ModelConfig, RopeConfig

    s = SHAPE
    return ModelConfig(
        architecture="x",
        family=arch,
        num_layers=s["layers"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"],
        vocab_size=s["vocab"],
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope=RopeConfig(),
        tie_word_embeddings=tied,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )


def _expected_state(tensors: dict[str, np.ndarray], qtype) -> dict[str, torch.Tensor]:
    """Our parameter name -> its value: the Hugging Face tensors fused as the decoder holds them,
    each matrix through quantize/dequantize when the file stores it quantized."""
    from pagedllm.models.loader import checkpoint_layout

    cfg = _config("llama", True)

    def value(name):
        v = tensors[name]
        if v.ndim == 2 and qtype != Q.F32:
            v = gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype)
        return torch.from_numpy(np.ascontiguousarray(v))

    return {
        param: torch.cat([value(n) for n in sources])
        for param, sources in checkpoint_layout(cfg).items()
    }


def test_llama_metadata_becomes_the_model_config(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    cfg = read_gguf_config(tmp_path / "m.gguf")
    assert (cfg.family, cfg.architecture) == ("llama", "LlamaForCausalLM")
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 96)
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps) == (256, pytest.approx(1e-5))
    assert cfg.tie_word_embeddings and cfg.rope.theta == 10000.0


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_llama_weights_load_unpermuted_and_in_their_type(tmp_path, qtype):
    tensors = write_gguf(tmp_path / "m.gguf", qtype=qtype)
    model = load_model(tmp_path / "m.gguf", device="cpu")
    state = model.state_dict()
    for param, expected in _expected_state(tensors, qtype).items():
        torch.testing.assert_close(state[param], expected, rtol=0, atol=0, msg=param)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert (qkv.quant is None) == (qtype == Q.F32)


def test_quantized_model_runs_like_its_dequantized_weights(tmp_path):
    write_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    model = load_model(tmp_path / "m.gguf", device="cpu")
    x = torch.randn(3, 64)
    qkv = model.model.layers[1].self_attn.qkv_proj
    dense = model.state_dict()["model.layers.1.self_attn.qkv_proj.weight"]
    torch.testing.assert_close(qkv.forward(x), x @ dense.T, rtol=1e-4, atol=1e-4)
    ids = torch.tensor([0, 5, 95])
    torch.testing.assert_close(
        model.model.embed_tokens(ids), model.state_dict()["model.embed_tokens.weight"][ids]
    )


def test_qwen3_file_has_qk_norm_and_no_permutation(tmp_path):
    tensors = write_gguf(tmp_path / "m.gguf", arch="qwen3")
    model = load_model(tmp_path / "m.gguf", device="cpu")
    assert model.config.qk_norm and model.config.family == "qwen3"
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(
        model.model.layers[0].self_attn.qkv_proj.weight[:64], torch.from_numpy(q)
    )


def test_untied_output_head_is_read(tmp_path):
    tensors = write_gguf(tmp_path / "m.gguf", tied=False)
    model = load_model(tmp_path / "m.gguf", device="cpu")
    assert not model.config.tie_word_embeddings
    torch.testing.assert_close(model.lm_head.weight, torch.from_numpy(tensors["lm_head.weight"]))


def test_not_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_config(path)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="truncated"):
        load_model(path, device="cpu")


def test_unsupported_tensor_type_names_the_tensor_and_type(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=Q.IQ4_NL)
    with pytest.raises(GGUFError, match=r"tensor 'token_embd\.weight' has type IQ4_NL"):
        load_model(path, device="cpu")


def test_unknown_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, arch="gemma")
    with pytest.raises(GGUFError, match="unsupported architecture 'gemma'"):
        read_gguf_config(path)


def test_head_count_disagreeing_with_tensor_shapes_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, heads=8)  # 8 heads of 64 / 8 = 8 -> q rows 64, k rows 16: not the file's 32
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_k\.weight' has shape .*inconsistent"):
        load_model(path, device="cpu")


def test_missing_tensor_is_a_clear_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.1\.ffn_down\.weight'"):
        load_model(path, device="cpu")


def test_gguf_errors_are_value_errors():
    assert issubclass(GGUFError, ValueError)


def test_header_reads_every_value_type_as_the_gguf_package_does(tmp_path):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_int64("t.i64", -3)
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strings", ["a", "", "ü"])
    writer.add_array("t.floats", [1.5, -2.0])
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = gguf.GGUFReader(str(path))
    ours = GGUFFile(path)
    for name, field in theirs.fields.items():
        if not name.startswith("GGUF."):
            assert ours.metadata[name] == field.contents(), name
    assert np.array_equal(
        ours.tensors["w"].data.view(np.float32).reshape(2, 32), theirs.tensors[0].data
    )


def test_a_header_cut_short_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(path)
    head = path.read_bytes()[:200]
    path.write_bytes(head)
    with pytest.raises(GGUFError, match="cut short|truncated"):
        read_gguf_config(path)
