"""What `LLM.embed` and `LLM.score` run on a `PoolingEngine`, and the pairing rules the
server's /v1/score and /v1/rerank share with them.

Scoring (vLLM's `LLM.score`): a classification model (a cross-encoder, `*ForSequenceClassification`)
reads each (query, document) pair as one prompt — the query's tokens, then the document's, as
the tokenizer encodes a text pair (a causal LM reranking by two tokens, `hf_overrides`: the
two texts joined) — and the score is its head's sigmoid; an embedding model embeds both texts
and the score is their cosine similarity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pagedllm.engine.batch import generate_batch
from pagedllm.engine.inputs import PromptType
from pagedllm.pooling.engine import PoolingEngine
from pagedllm.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.score_template import render_score_prompt


def pooling_engine(engine) -> PoolingEngine:
    """`engine` if it pools, else a ValueError naming `runner`."""
    if not isinstance(engine, PoolingEngine):
        raise ValueError(
            "this model runs runner='generate'; embeddings and scores need "
            "LLM(model, runner='pooling') (pagedllm serve --runner pooling)"
        )
    return engine


def run_pooling(
    engine: PoolingEngine,
    request_ids: Sequence[str],
    prompts: Sequence[PromptType],
    params: PoolingParams,
    on_done: Callable[[int], object] | None = None,
) -> list[PoolingRequestOutput]:
    """Every prompt's finished pooling output, in order."""
    count = len(prompts)
    return generate_batch(
        engine, request_ids, prompts, [params] * count, [0] * count, [None] * count, on_done
    )


def embed(
    engine: PoolingEngine,
    request_ids: Sequence[str],
    prompts: Sequence[PromptType],
    params: PoolingParams,
    on_done=None,
) -> list[EmbeddingRequestOutput]:
    if engine.task != "embed":
        raise ValueError(
            "embed: this model is a classifier (task 'classify'); use score(), or "
            "convert='embed' to pool its hidden states"
        )
    outputs = run_pooling(engine, request_ids, prompts, params, on_done)
    return [
        EmbeddingRequestOutput(
            o.request_id, EmbeddingOutput(o.pooled.tolist()), list(o.prompt_token_ids)
        )
        for o in outputs
    ]


def score_pairs(queries: str | Sequence[str], documents: str | Sequence[str]) -> list[tuple]:
    """(query, document) pairs: one query against every document, or N queries with N
    documents, pair by pair (vLLM's rule). ValueError naming the side that is wrong."""
    queries = [queries] if isinstance(queries, str) else list(queries)
    documents = [documents] if isinstance(documents, str) else list(documents)
    if not queries:
        raise ValueError("queries (text_1) is empty")
    if not documents:
        raise ValueError("documents (text_2) is empty")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise ValueError(
            f"documents (text_2) has {len(documents)} entries for {len(queries)} queries "
            "(text_1): give one query, or as many queries as documents"
        )
    return list(zip(queries, documents))


def pair_token_ids(tokenizer, query: str, document: str) -> list[int]:
    """The cross-encoder's prompt of a pair: the tokenizer's text-pair encoding (its pair
    template, where it has one), else the query's tokens then the document's."""
    from tokenizers import Tokenizer as RustTokenizer

    backend = getattr(tokenizer, "backend", None)
    if isinstance(backend, RustTokenizer):
        return list(backend.encode(query, pair=document, add_special_tokens=True).ids)
    if backend is not None:  # a transformers tokenizer
        return list(backend(query, document)["input_ids"])
    return tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)


def score_prompt_ids(
    engine: PoolingEngine, query: str, document: str, chat_template: str | None = None
) -> list[int]:
    """A classifier's prompt of a pair: with a score template (`chat_template`, see
    `score_template.py`), the rendered text; else a causal LM made a reranker by `hf_overrides`
    reads the two texts joined, with no separator (vLLM's "LLM as reranker": the caller's query
    and document carry the template), and a cross-encoder the tokenizer's text pair
    (`pair_token_ids`). A fixed text opening every pair is a shared prefix (prefix cache)."""
    if chat_template is not None:
        text = render_score_prompt(chat_template, query, document, engine.tokenizer)
        return list(engine.tokenizer.encode(text))
    if engine.token_classifier is not None:
        return list(engine.tokenizer.encode(query + document))
    return pair_token_ids(engine.tokenizer, query, document)


def single_score(output: PoolingRequestOutput) -> float:
    """The score of a single-logit classification head (the only kind that scores pairs)."""
    if output.pooled.numel() != 1:
        raise ValueError(
            f"score: the classification head has {output.pooled.numel()} labels; scoring "
            "pairs needs a single-logit head (a reranker)"
        )
    return float(output.pooled[0])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1))


def score(
    engine: PoolingEngine,
    new_id: Callable[[], str],
    queries,
    documents,
    on_done=None,
    chat_template: str | None = None,
) -> list[ScoringRequestOutput]:
    """One score per pair (`score_pairs`); see the module docstring. `chat_template`: a score
    template for a classifier's pairs (`score_prompt_ids`)."""
    pairs = score_pairs(queries, documents)
    if chat_template is not None and engine.task != "classify":
        raise ValueError(
            "chat_template: a score template is for a classifier (a reranker); this model "
            "embeds, and scores by cosine similarity"
        )
    if engine.task == "classify":
        if engine.tokenizer is None:
            raise ValueError("score needs a tokenizer (the engine has none)")
        prompts = [
            {"prompt_token_ids": score_prompt_ids(engine, q, d, chat_template)} for q, d in pairs
        ]
        ids = [new_id() for _ in prompts]
        outputs = run_pooling(engine, ids, prompts, PoolingParams(), on_done)
        return [
            ScoringRequestOutput(o.request_id, ScoringOutput(single_score(o)), o.prompt_token_ids)
            for o in outputs
        ]
    texts = [q for q, _ in pairs] + [d for _, d in pairs]
    outputs = run_pooling(engine, [new_id() for _ in texts], texts, PoolingParams(), on_done)
    half = len(pairs)
    return [
        ScoringRequestOutput(
            new_id(),
            ScoringOutput(cosine(q.pooled, d.pooled)),
            list(q.prompt_token_ids) + list(d.prompt_token_ids),
        )
        for q, d in zip(outputs[:half], outputs[half:])
    ]
