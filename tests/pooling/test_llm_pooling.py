"""`LLM(model, runner="pooling")`: `embed` and `score` (vLLM's offline API) against transformers,
and what each kind of LLM refuses."""

from __future__ import annotations

import pytest
from pooling.checkpoints import (
    cosine,
    reference_embedding,
    reference_score,
    save_embedding_checkpoint,
    save_reranker_checkpoint,
)

from pagedllm import LLM

ENGINE = dict(num_gpu_blocks=64, block_size=16, max_model_len=128, device="cpu")


def test_llm_embed_gives_transformers_embeddings(tmp_path):
    folder = save_embedding_checkpoint(tmp_path, pooling="mean")
    llm = LLM(str(folder), runner="pooling", **ENGINE)
    outputs = llm.embed(["hello world", {"prompt_token_ids": [5, 6, 7]}])
    ids = llm.get_tokenizer().encode("hello world")
    assert outputs[0].prompt_token_ids == ids
    assert cosine(outputs[0].outputs.embedding, reference_embedding(folder, ids, "mean")) >= 0.9999
    expected = reference_embedding(folder, [5, 6, 7], "mean")
    assert cosine(outputs[1].outputs.embedding, expected) >= 0.9999


def test_llm_score_gives_the_sigmoid_of_the_classification_logit(tmp_path):
    from pagedllm.pooling.offline import pair_token_ids

    folder = save_reranker_checkpoint(tmp_path)
    llm = LLM(str(folder), runner="pooling", **ENGINE)
    (output,) = llm.score("a fox", ["a lazy dog"])
    ids = pair_token_ids(llm.get_tokenizer(), "a fox", "a lazy dog")
    assert output.outputs.score == pytest.approx(reference_score(folder, ids), abs=1e-5)


def test_a_generating_llm_refuses_to_embed_naming_the_runner():
    llm = LLM("pagedllm/tiny-random", **ENGINE)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed("hello")


def test_a_pooling_llm_refuses_to_generate(tmp_path):
    llm = LLM(str(save_embedding_checkpoint(tmp_path)), runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate("hello", use_tqdm=False)
