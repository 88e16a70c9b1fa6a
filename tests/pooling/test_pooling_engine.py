"""The pooling engine against transformers: last-token, mean and CLS embeddings (chunked prefill
included), Matryoshka dimensions, and which pooling shares the prefix cache."""

from __future__ import annotations

import itertools

import pytest
import torch
from pooling.checkpoints import cosine, reference_embedding, save_embedding_checkpoint

from pagedllm.config import EngineArgs
from pagedllm.pooling import PoolingEngine, PoolingParams, build_engine
from pagedllm.pooling.offline import run_pooling

ENGINE = dict(runner="pooling", num_gpu_blocks=64, block_size=16, max_model_len=128, device="cpu")
# three prompts: one over two chunks of the 16-token budget, one of exactly a block, one short
PROMPTS = [list(range(3, 43)), list(range(100, 116)), [7, 8, 9]]
_ids = itertools.count()


def pool(engine: PoolingEngine, prompts, params: PoolingParams | None = None):
    ids = [f"r{next(_ids)}" for _ in prompts]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return run_pooling(engine, ids, inputs, params or PoolingParams())


@pytest.fixture(scope="module")
def last_token_model(tmp_path_factory):
    return save_embedding_checkpoint(tmp_path_factory.mktemp("qwen3-embed"), matryoshka=True)


def test_last_token_embeddings_equal_transformers_over_chunked_prefill(last_token_model):
    engine = build_engine(
        EngineArgs(model=str(last_token_model), max_num_batched_tokens=16, **ENGINE)
    )
    for output, prompt in zip(pool(engine, PROMPTS), PROMPTS):
        expected = reference_embedding(last_token_model, prompt)
        assert cosine(output.pooled, expected) >= 0.9999
        assert torch.linalg.norm(output.pooled) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_every_position_pooling_equals_transformers_over_chunked_prefill(tmp_path, mode):
    folder = save_embedding_checkpoint(tmp_path, pooling=mode, seed=1)
    engine = build_engine(EngineArgs(model=str(folder), max_num_batched_tokens=16, **ENGINE))
    assert engine.pooler_config.pooling_type == mode.upper()
    for output, prompt in zip(pool(engine, PROMPTS), PROMPTS):
        assert cosine(output.pooled, reference_embedding(folder, prompt, mode)) >= 0.9999


def test_mean_pooling_without_normalize_module_keeps_the_length(tmp_path):
    folder = save_embedding_checkpoint(tmp_path, pooling="mean", normalize=False)
    engine = build_engine(EngineArgs(model=str(folder), **ENGINE))
    (output,) = pool(engine, PROMPTS[:1])
    expected = reference_embedding(folder, PROMPTS[0], "mean", normalize=False)
    assert torch.allclose(output.pooled, expected, rtol=1e-4, atol=1e-4)


def test_dimensions_cut_a_matryoshka_embedding_and_normalize_it_again(last_token_model):
    engine = build_engine(EngineArgs(model=str(last_token_model), **ENGINE))
    (output,) = pool(engine, PROMPTS[2:], PoolingParams(dimensions=16))
    full = reference_embedding(last_token_model, PROMPTS[2])
    assert output.pooled.shape == (16,)
    assert cosine(output.pooled, full[:16]) >= 0.9999
    assert torch.linalg.norm(output.pooled) == pytest.approx(1.0, abs=1e-5)


def test_dimensions_are_refused_naming_the_field_without_matryoshka(tmp_path):
    engine = build_engine(EngineArgs(model=str(save_embedding_checkpoint(tmp_path)), **ENGINE))
    with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
        pool(engine, PROMPTS[2:], PoolingParams(dimensions=16))
    assert not engine.has_unfinished_requests()


def test_last_token_pooling_shares_the_prefix_cache(last_token_model):
    engine = build_engine(EngineArgs(model=str(last_token_model), **ENGINE))
    instruction = list(range(20, 68))  # three full blocks, computed once
    first, second = instruction + [5, 6], instruction + [9, 10, 11]
    (a,) = pool(engine, [first])
    (b,) = pool(engine, [second])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == len(instruction)
    assert cosine(b.pooled, reference_embedding(last_token_model, second)) >= 0.9999


def test_mean_pooling_takes_no_prefix_hit(tmp_path):
    folder = save_embedding_checkpoint(tmp_path, pooling="mean")
    engine = build_engine(EngineArgs(model=str(folder), enable_prefix_caching=True, **ENGINE))
    assert engine.args.enable_prefix_caching is False
    instruction = list(range(20, 68))
    pool(engine, [instruction + [5]])
    (b,) = pool(engine, [instruction + [9, 10]])
    assert b.num_cached_tokens == 0
    assert cosine(b.pooled, reference_embedding(folder, instruction + [9, 10], "mean")) >= 0.9999


def test_a_pooling_engine_refuses_sampling_params(last_token_model):
    from pagedllm.sampling_params import SamplingParams

    engine = build_engine(EngineArgs(model=str(last_token_model), **ENGINE))
    with pytest.raises(ValueError, match="takes PoolingParams"):
        engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams())


def test_an_input_of_max_model_len_is_pooled_and_a_longer_one_refused(last_token_model):
    engine = build_engine(EngineArgs(model=str(last_token_model), **ENGINE))
    longest = [(7 * i) % 300 for i in range(128)]
    (output,) = pool(engine, [longest])
    assert cosine(output.pooled, reference_embedding(last_token_model, longest)) >= 0.9999
    with pytest.raises(ValueError, match="the input has 129 tokens; max_model_len is 128"):
        pool(engine, [longest + [5]])
    assert not engine.has_unfinished_requests()
