"""Results of pooling requests (vLLM's names): the engine's `PoolingRequestOutput`, and what
`LLM.embed` and `LLM.score` return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.outputs import RequestOutput


@dataclass
class PoolingRequestOutput(RequestOutput):
    """A `RequestOutput` of the pooling engine: once finished (and not aborted), `pooled` is the
    float32 CPU tensor of the result — the embedding, or a classification head's scores."""

    pooled: Any = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`outputs.embedding`), as `LLM.embed` returns it."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One (query, document) pair's relevance (`outputs.score`), as `LLM.score` returns it."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
