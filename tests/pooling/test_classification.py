"""Classification heads (`*ForSequenceClassification`) on the pooling runner: scores equal the
sigmoid of transformers' logit on every dense family; what each runner refuses."""

from __future__ import annotations

import itertools

import pytest
from pooling.checkpoints import (
    cosine,
    reference_embedding,
    reference_score,
    save_embedding_checkpoint,
    save_reranker_checkpoint,
)

from pagedllm.checkpoint.errors import CheckpointError
from pagedllm.config import EngineArgs
from pagedllm.pooling import build_engine
from pagedllm.pooling.offline import pair_token_ids, score

ENGINE = dict(runner="pooling", num_gpu_blocks=64, block_size=16, max_model_len=128, device="cpu")
QUERY = "the quick brown fox"
DOCUMENTS = ["jumps over the lazy dog", "paged attention keeps blocks", "hello world"]
_ids = itertools.count()


def new_id() -> str:
    return f"s{next(_ids)}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_scores_are_the_sigmoid_of_transformers_classification_logit(tmp_path, family):
    folder = save_reranker_checkpoint(tmp_path, family)
    engine = build_engine(EngineArgs(model=str(folder), **ENGINE))
    assert engine.task == "classify"
    outputs = score(engine, new_id, QUERY, DOCUMENTS)
    for output, document in zip(outputs, DOCUMENTS):
        ids = pair_token_ids(engine.tokenizer, QUERY, document)
        assert output.prompt_token_ids == ids
        assert output.outputs.score == pytest.approx(reference_score(folder, ids), abs=1e-5)


def test_pairs_score_one_query_per_document(tmp_path):
    folder = save_reranker_checkpoint(tmp_path)
    engine = build_engine(EngineArgs(model=str(folder), **ENGINE))
    queries = ["a fox", "a dog"]
    outputs = score(engine, new_id, queries, DOCUMENTS[:2])
    for output, query, document in zip(outputs, queries, DOCUMENTS):
        expected = reference_score(folder, pair_token_ids(engine.tokenizer, query, document))
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="documents"):
        score(engine, new_id, queries, DOCUMENTS)


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path):
    folder = save_embedding_checkpoint(tmp_path)
    engine = build_engine(EngineArgs(model=str(folder), **ENGINE))
    (output,) = score(engine, new_id, QUERY, DOCUMENTS[:1])
    tokenizer = engine.tokenizer
    expected = cosine(
        reference_embedding(folder, tokenizer.encode(QUERY)),
        reference_embedding(folder, tokenizer.encode(DOCUMENTS[0])),
    )
    assert output.outputs.score == pytest.approx(expected, abs=1e-4)


def test_convert_embed_pools_a_classifier_body(tmp_path):
    folder = save_reranker_checkpoint(tmp_path)
    engine = build_engine(EngineArgs(model=str(folder), convert="embed", **ENGINE))
    assert engine.task == "embed" and engine.model.score is None
    from pagedllm.pooling.offline import embed
    from pagedllm.pooling.params import PoolingParams

    (output,) = embed(engine, [new_id()], [{"prompt_token_ids": [5, 6, 7]}], PoolingParams())
    assert cosine(output.outputs.embedding, reference_embedding(folder, [5, 6, 7])) >= 0.9999


def test_the_generate_runner_refuses_a_classification_checkpoint(tmp_path):
    folder = save_reranker_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="runner='pooling'"):
        build_engine(EngineArgs(model=str(folder), num_gpu_blocks=64, device="cpu"))


def test_convert_classify_needs_a_score_head(tmp_path):
    folder = save_embedding_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="score.weight"):
        build_engine(EngineArgs(model=str(folder), convert="classify", **ENGINE))


def test_convert_needs_the_pooling_runner():
    with pytest.raises(ValueError, match="convert='embed' needs runner='pooling'"):
        EngineArgs(convert="embed")
