"""A causal Qwen3 made a Qwen3-Reranker by vLLM's hf_overrides: scores equal transformers'
sigmoid(logits[-1, yes] - logits[-1, no]) on the same text (the pair joined, or a score template
rendered), the fixed instruction is computed once (prefix cache), and what cannot be done is a
ValueError naming the field."""

from __future__ import annotations

import itertools

import pytest
from pooling.checkpoints import (
    reference_token_score,
    save_reranker_checkpoint,
    token_reranker_overrides,
)

from pagedllm.config import EngineArgs
from pagedllm.pooling import PoolingEngine, PoolingParams, build_engine
from pagedllm.pooling.offline import run_pooling, score, score_prompt_ids

from model_factory import save_tiny_checkpoint

ENGINE = dict(runner="pooling", num_gpu_blocks=64, block_size=16, max_model_len=256, device="cpu")
# Qwen3-Reranker's prompt, as its users write it around the query and the document
PREFIX = "<|im_start|>system\nJudge whether the Document meets the Query. Answer he or lo.\n"
QUERY = PREFIX + "<Query>: the quick brown fox\n"
DOCUMENTS = ["<Document>: jumps over the lazy dog", "<Document>: paged attention blocks"]
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# a score template in the shape of vLLM's qwen3_reranker.jinja (messages: query, document)
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the Query. Answer he or lo.\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') "
    "| first }}\n<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first)"
    "['content'] }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
_ids = itertools.count()


def new_id() -> str:
    return f"t{next(_ids)}"


@pytest.fixture(scope="module")
def causal_qwen3(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-reranker"), "qwen3")


@pytest.fixture(scope="module")
def reranker(causal_qwen3) -> PoolingEngine:
    args = EngineArgs(model=str(causal_qwen3), hf_overrides=token_reranker_overrides(), **ENGINE)
    return build_engine(args)


def vocab_ids(engine: PoolingEngine) -> tuple[int, int]:
    vocab = engine.tokenizer.backend.get_vocab()
    false_token, true_token = token_reranker_overrides()["classifier_from_token"]
    return vocab[false_token], vocab[true_token]


def test_scores_are_the_sigmoid_of_transformers_token_log_odds(reranker, causal_qwen3):
    assert reranker.task == "classify" and reranker.model.score.out_features == 1
    documents = [d + SUFFIX for d in DOCUMENTS]
    outputs = score(reranker, new_id, QUERY, documents)
    for output, document in zip(outputs, documents):
        ids = reranker.tokenizer.encode(QUERY + document)  # vLLM's: the two texts joined
        assert output.prompt_token_ids == ids
        expected = reference_token_score(causal_qwen3, ids, *vocab_ids(reranker))
        assert output.outputs.score == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_score_template_renders_each_pair_before_scoring(reranker, causal_qwen3):
    queries = ["the quick brown fox", "paged attention"]
    documents = ["jumps over the lazy dog", "keeps its blocks"]
    outputs = score(reranker, new_id, queries, documents, chat_template=TEMPLATE)
    for output, query, document in zip(outputs, queries, documents):
        text = TEMPLATE.split("<Query>")[0] + f"<Query>: {query}\n<Document>: {document}"
        text += "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n"  # jinja drops one \n
        ids = reranker.tokenizer.encode(text)
        assert output.prompt_token_ids == ids
        expected = reference_token_score(causal_qwen3, ids, *vocab_ids(reranker))
        assert output.outputs.score == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_the_fixed_instruction_is_computed_once(reranker, causal_qwen3):
    instruction = "<Instruct>: retrieve the passages that answer it\n" + PREFIX  # not seen before
    first = score_prompt_ids(reranker, instruction + "<Query>: a fox\n", DOCUMENTS[0] + SUFFIX)
    second = score_prompt_ids(reranker, instruction + "<Query>: a dog\n", DOCUMENTS[1] + SUFFIX)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 3 * 16  # three full blocks of the instruction
    prompts = [{"prompt_token_ids": first}], [{"prompt_token_ids": second}]
    (a,) = run_pooling(reranker, [new_id()], prompts[0], PoolingParams())
    (b,) = run_pooling(reranker, [new_id()], prompts[1], PoolingParams())
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == shared // 16 * 16
    expected = reference_token_score(causal_qwen3, second, *vocab_ids(reranker))
    assert float(b.pooled[0]) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_token_outside_the_vocabulary_is_refused_naming_classifier_from_token(causal_qwen3):
    overrides = token_reranker_overrides("no", "yes")  # not single tokens of the tiny vocabulary
    with pytest.raises(ValueError, match=r"classifier_from_token: 'no' is not a single token"):
        build_engine(EngineArgs(model=str(causal_qwen3), hf_overrides=overrides, **ENGINE))


def test_the_overrides_on_a_classification_checkpoint_are_refused(tmp_path):
    folder = save_reranker_checkpoint(tmp_path)
    overrides = token_reranker_overrides()
    with pytest.raises(ValueError, match=r"hf_overrides\.architectures: .* not a causal LM"):
        build_engine(EngineArgs(model=str(folder), hf_overrides=overrides, **ENGINE))


def test_an_architecture_of_another_family_is_refused(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "llama")
    overrides = token_reranker_overrides()
    with pytest.raises(ValueError, match=r"architectures: 'Qwen3ForSequenceClassification' does"):
        build_engine(EngineArgs(model=str(folder), hf_overrides=overrides, **ENGINE))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"trust_remote_code": True}, "key 'trust_remote_code' is not supported"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "hf_overrides.architectures"),
        ({"classifier_from_token": ["no", "yes", "maybe"]}, "classifier_from_token"),
        ({"classifier_from_token": "yes"}, "classifier_from_token"),
        ({"is_original_qwen3_reranker": "yes"}, "is_original_qwen3_reranker"),
        ({"is_original_qwen3_reranker": False}, "hf_overrides.method"),
        ({"method": "no_post_processing"}, "hf_overrides.method"),
    ],
)
def test_a_bad_override_is_a_value_error_naming_it(change, named):
    overrides = token_reranker_overrides() | change
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        EngineArgs(hf_overrides=overrides, runner="pooling")


@pytest.mark.parametrize("runner_args", [{"runner": "generate"}, {"convert": "embed"}])
def test_the_overrides_need_a_classifying_pooling_runner(runner_args):
    args = {"runner": "pooling", **runner_args}
    with pytest.raises(ValueError, match="hf_overrides .* needs runner='pooling'"):
        EngineArgs(hf_overrides=token_reranker_overrides(), **args)


def test_a_score_template_on_an_embedding_model_is_refused(tmp_path):
    folder = save_tiny_checkpoint(tmp_path, "qwen3")
    engine = build_engine(EngineArgs(model=str(folder), **ENGINE))
    with pytest.raises(ValueError, match="chat_template: a score template is for a classifier"):
        score(engine, new_id, "a", ["b"], chat_template=TEMPLATE)


def test_convert_classify_with_the_overrides_scores_the_same(reranker, causal_qwen3):
    args = EngineArgs(
        model=str(causal_qwen3),
        hf_overrides=token_reranker_overrides(),
        **(ENGINE | {"convert": "classify"}),
    )
    engine = build_engine(args)
    (expected,) = score(reranker, new_id, QUERY, DOCUMENTS[:1])
    (got,) = score(engine, new_id, QUERY, DOCUMENTS[:1])
    assert got.outputs.score == pytest.approx(expected.outputs.score, rel=1e-6)
