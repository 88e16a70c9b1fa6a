"""Hybrid KV groups end to end (issue 42): an engine serving a model with sliding windows gives
the scheduler the model's layer groups, so a window group keeps only its window's blocks and the
same cache bytes hold several times the sequences. A tiny random Gemma-3-shaped checkpoint
(5 local layers, window 32 : 1 global), float32 on the CPU; memory is measured from the
scheduler's block pool, in layer-blocks (blocks x a block's layers: the cache's bytes)."""

from __future__ import annotations

import logging

import pytest
from transformers import Gemma3TextConfig

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

from model_factory import build_hf_model, save_tiny_tokenizer

WINDOW = 32
LOCAL = ["sliding_attention"] * 5 + ["full_attention"]


def _save(folder, layer_types):
    config = Gemma3TextConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=4096,
        sliding_window=WINDOW,
        layer_types=layer_types,
        bos_token_id=0,
        eos_token_id=1,
    )
    build_hf_model(config, seed=5).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("gemma3_hybrid"), LOCAL)


@pytest.fixture(scope="module")
def gemma3_full(tmp_path_factory):
    """The same shape with every layer full attention: what the cache held before groups."""
    return _save(tmp_path_factory.mktemp("gemma3_full"), ["full_attention"] * 6)


def _engine(folder, **overrides) -> LLMEngine:
    args = dict(
        model=str(folder),
        device="cpu",
        dtype="float32",
        cpu_threads=1,
        block_size=16,
        max_model_len=4096,
        scheduling="chunked_prefill",
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    return LLMEngine(EngineArgs(**{**args, **overrides}))


def _layer_blocks_in_use(engine: LLMEngine) -> int:
    stats = engine.scheduler.get_stats()
    layers_per_block = engine.cache_engine.kv_cache.shape[1]
    return (stats["num_gpu_blocks"] - stats["num_free_gpu_blocks"]) * layers_per_block


def _held_after_3k_tokens(folder) -> int:
    """Layer-blocks one request holds after a 3,072-token prompt and 31 decoded tokens."""
    engine = _engine(folder)
    try:
        prompt = [(i * 37 + 5) % 300 + 2 for i in range(3072)]
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        held = 0
        while engine.has_unfinished_requests():
            if not any(out.finished for out in engine.step()):
                held = _layer_blocks_in_use(engine)
        return held
    finally:
        engine.shutdown()


def test_a_gemma3_layout_holds_at_most_a_quarter_of_full_attention_end_to_end(gemma3, gemma3_full):
    local, full = _held_after_3k_tokens(gemma3), _held_after_3k_tokens(gemma3_full)
    assert full == 6 * 194  # 3,103 tokens in blocks of 16, every layer
    assert local * 4 <= full, (local, full)


def _peak_running(folder, num_gpu_blocks: int) -> tuple[int, int]:
    """(most requests running at once, the cache's bytes) for 8 requests of 600 tokens."""
    engine = _engine(
        folder, num_gpu_blocks=num_gpu_blocks, max_model_len=640, max_num_batched_tokens=128
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        for r in range(8):
            prompt = [(i * 7 + r) % 300 + 2 for i in range(600)]
            engine.add_request(str(r), {"prompt_token_ids": prompt}, params)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.scheduler.get_stats()["num_running"])
        return peak, engine.cache_engine.stats()["kv_cache_bytes"]
    finally:
        engine.shutdown()


def test_the_same_cache_bytes_run_at_least_twice_the_sequences(gemma3, gemma3_full):
    # full attention: 100 blocks of 6 layers hold 2 requests of 632 tokens (40 blocks each),
    # a third one partly; the hybrid layout's blocks hold 1 layer: 600 are the same bytes
    full, full_bytes = _peak_running(gemma3_full, 100)
    local, local_bytes = _peak_running(gemma3, 600)
    assert local_bytes == full_bytes
    assert local >= 2 * full, (local, full)


def test_the_engine_says_its_kv_groups_in_the_log_and_stats(gemma3, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = _engine(gemma3, max_model_len=256)
    try:
        assert engine.scheduler.kv_groups == [None] + [WINDOW] * 5
        assert engine.get_stats()["kv_groups"] == "6 groups (1 x full, 5 x window 32) of 1 layers"
        assert "KV cache layer groups: 6 groups" in caplog.text
        # tokens every group holds (vLLM's count), not blocks x block size
        blocks = engine.cache_engine.num_gpu_blocks
        assert engine.get_stats()["kv_cache_num_tokens"] == blocks // 6 * 16
    finally:
        engine.shutdown()


def test_a_window_at_least_max_model_len_keeps_one_full_attention_group(gemma3):
    engine = _engine(gemma3, max_model_len=WINDOW, max_num_batched_tokens=64)
    try:
        assert engine.scheduler.kv_groups == [None]
        assert engine.cache_engine.kv_cache.shape[1] == 6
    finally:
        engine.shutdown()


def test_the_offload_tier_keeps_one_group_and_says_why(gemma3, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = _engine(
            gemma3, max_model_len=256, kv_offloading_size=0.01, enable_prefix_caching=True
        )
    try:
        assert engine.scheduler.kv_groups == [None]
        assert "offload tier" in caplog.text
    finally:
        engine.shutdown()


def test_ngram_speculation_over_hybrid_groups_gives_the_tokens_of_plain_decoding(gemma3):
    # drafts rejected are truncated from every group's table, windows included
    prompts = [{"prompt_token_ids": [(i * 7 + r) % 50 + 2 for i in range(150)]} for r in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", block_size=4, max_model_len=256)
    want = LLM(str(gemma3), **common).generate(prompts, params, use_tqdm=False)
    spec = LLM(
        str(gemma3),
        **common,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    got = spec.generate(prompts, params, use_tqdm=False)
    assert spec.engine.scheduler.kv_groups == [None] + [WINDOW] * 5
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_a_draft_model_keeps_one_kv_group_and_says_why(gemma3):
    draft = {"method": "draft_model", "model": str(gemma3), "num_speculative_tokens": 2}
    args = EngineArgs(model=str(gemma3), device="cpu", speculative_config=draft)
    assert "draft model" in args.hybrid_kv_off_reason
    assert EngineArgs(model=str(gemma3), device="cpu").hybrid_kv_off_reason is None
