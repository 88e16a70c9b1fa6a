"""Request bodies of the pooling routes: OpenAI's `/v1/embeddings`, vLLM's `/v1/score` and the
Jina/Cohere-shaped `/v1/rerank` (vLLM's names and defaults). Like the other bodies, an
undeclared field is refused and null means the default."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

TokenIds = list[StrictInt]


class _PoolingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    user: StrictStr | None = None  # accepted, without effect (as on the other routes)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class EmbeddingRequest(_PoolingBody):
    """OpenAI's: `input` a string, a list of strings, a list of token ids or a list of
    token-id lists."""

    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None


class ScoreRequest(_PoolingBody):
    """vLLM's: `text_1` (the query or queries) against `text_2` (the documents); `queries` /
    `documents` are the same fields under their newer names."""

    text_1: StrictStr | list[StrictStr] | None = None
    text_2: StrictStr | list[StrictStr] | None = None
    queries: StrictStr | list[StrictStr] | None = None
    documents: StrictStr | list[StrictStr] | None = None


class RerankRequest(_PoolingBody):
    """vLLM's and Jina's/Cohere's: the `documents` ranked by relevance to `query`, the best
    `top_n` (all when 0 or absent)."""

    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt = Field(0, ge=0)
    return_documents: bool = True
