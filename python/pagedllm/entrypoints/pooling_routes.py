"""The pooling routes: `POST /v1/embeddings` (OpenAI's), `POST /v1/score` and `POST /v1/rerank`
(vLLM's; also at `/score`, `/rerank` and `/v2/rerank`), served by a `--runner pooling` server
(`pagedllm.pooling.PoolingEngine`).

A server of the other kind answers them with a 400 naming `model`, and a pooling server answers
the generating routes so too (its routes are registered first: they win the match). Every
client mistake is a 400 in OpenAI's error shape naming the field: a malformed body, an empty
input, an input over `max_model_len`, `dimensions` a model cannot give, a rerank without
documents.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.errors import APIError, ErrorResponse, bad_request, unavailable
from pagedllm.entrypoints.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagedllm.executor.errors import EngineDeadError
from pagedllm.pooling import PoolingEngine, PoolingParams
from pagedllm.pooling.offline import cosine, score_pairs, score_prompt_ids, single_score

_CLIENT_ERROR = {
    "4XX": {"model": ErrorResponse, "description": "A client error (400: a bad field)"}
}
GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def register_pooling_routes(app: FastAPI, server) -> None:
    """Adds the pooling routes to `app` (call before the generating routes are added)."""
    engine = server.engine.engine
    pooling = engine if isinstance(engine, PoolingEngine) else None
    if pooling is not None:
        for path in GENERATING_PATHS:
            app.post(path, include_in_schema=False)(_not_generating(path))

    async def embeddings(request: Request):
        body = await _parse(request, EmbeddingRequest)
        return await _embeddings(server, _pooler(pooling, "/v1/embeddings"), body, request)

    async def score(request: Request):
        body = await _parse(request, ScoreRequest)
        return await _score(server, _pooler(pooling, "/v1/score"), body, request)

    async def rerank(request: Request):
        body = await _parse(request, RerankRequest)
        return await _rerank(server, _pooler(pooling, "/v1/rerank"), body, request)

    routes = {
        ("/v1/embeddings",): (embeddings, EmbeddingRequest),
        ("/v1/score", "/score"): (score, ScoreRequest),
        ("/v1/rerank", "/rerank", "/v2/rerank"): (rerank, RerankRequest),
    }
    for paths, (handler, model) in routes.items():
        for i, path in enumerate(paths):
            app.post(
                path,
                responses=_CLIENT_ERROR,
                include_in_schema=i == 0,
                openapi_extra={"requestBody": _request_body(model)},
            )(handler)


def _request_body(model: type[BaseModel]) -> dict:
    return {
        "required": True,
        "content": {"application/json": {"schema": model.model_json_schema()}},
    }


def _not_generating(path: str):
    async def refuse():
        raise APIError(
            400,
            f"{path}: this server runs a pooling model (--runner pooling); it answers "
            "/v1/embeddings, /v1/score and /v1/rerank, and generates no text",
            param="model",
        )

    return refuse


def _pooler(engine: PoolingEngine | None, path: str) -> PoolingEngine:
    if engine is None:
        raise APIError(
            400,
            f"{path}: this server runs a generating model; embeddings and scores need a "
            "pooling model (pagedllm serve --runner pooling)",
            param="model",
        )
    return engine


async def _parse(request: Request, model: type[BaseModel]):
    """The body as `model`; a 400 naming the first bad field."""
    try:
        data = json.loads(await request.body())
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # per top-level field, what is wrong with it (a union's branches folded into one line)
        problems: dict[str, list[str]] = {}
        for error in exc.errors():
            loc = error.get("loc") or ("body",)
            msgs = problems.setdefault(str(loc[0]), [])
            if error["msg"] not in msgs:
                msgs.append(error["msg"])
        message = "; ".join(f"{field}: {' or '.join(msgs)}" for field, msgs in problems.items())
        param = next(iter(problems))
        raise APIError(400, message, param=None if param == "body" else param) from None


# ---- the work ----------------------------------------------------------------------------------


def _check_prompt(server, ids: list[int], field: str, index: int) -> None:
    if not ids:
        raise APIError(400, f"{field}[{index}] is empty", param=field)
    limit = server.engine.max_model_len
    if len(ids) > limit:
        raise APIError(
            400, f"{field}[{index}] has {len(ids)} tokens; max_model_len is {limit}", param=field
        )
    vocab = server.engine.engine.model_config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"{field}[{index}]: token id {bad} is outside the vocabulary [0, {vocab})",
            param=field,
        )


async def _encode(server, texts: list[str], field: str) -> list[list[int]]:
    tokenizer = server.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, f"{field}: text inputs need a tokenizer", param=field)
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: valid JSON, not Unicode
            message = f"{field}[{i}] is not valid Unicode ({exc.reason})"
            raise APIError(400, message, param=field) from None
    return await asyncio.to_thread(lambda: [tokenizer.encode(t) for t in texts])


async def _pool(server, prompts: list[list[int]], params: PoolingParams, field: str):
    """Runs one pooling request per prompt on the engine loop; their final outputs, in order."""
    for i, ids in enumerate(prompts):
        _check_prompt(server, ids, field, i)
    base = uuid.uuid4().hex
    with server.admission(len(prompts), sum(map(len, prompts))):
        try:
            pending = [
                server.engine.submit(
                    f"pool-{base}-{i}",
                    {"prompt_token_ids": ids},
                    params,
                    num_prompt_tokens=len(ids),
                )
                for i, ids in enumerate(prompts)
            ]
        except EngineDeadError as exc:
            raise unavailable(str(exc)) from None
    try:
        outputs = []
        for p in pending:
            await p.added
            while True:
                item = await p.queue.get()
                if isinstance(item, BaseException):
                    raise unavailable(str(item))
                if item.finished:
                    break
            if item.pooled is None:
                raise unavailable(f"request {p.request_id} was aborted")
            outputs.append(item)
        return outputs
    except EngineDeadError as exc:
        _abort(server, pending)
        raise unavailable(str(exc)) from None
    except (ValueError, TypeError) as exc:
        _abort(server, pending)
        raise bad_request(exc) from None
    except BaseException:
        _abort(server, pending)
        raise


def _abort(server, pending) -> None:
    for p in pending:
        server.engine.abort(p.request_id)


def _usage(outputs) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _model(server, body) -> str:
    server.check_model(body.model)
    return body.model or server.model_name


async def _embeddings(server, engine: PoolingEngine, body: EmbeddingRequest, request: Request):
    model = _model(server, body)
    if engine.task != "embed":
        raise APIError(
            400, "this model is a classifier: use /v1/score or /v1/rerank", param="model"
        )
    params = PoolingParams(body.dimensions)
    try:
        params.check(engine.pooler_config, engine.model_config.hidden_size)
    except ValueError as exc:
        raise APIError(400, str(exc), param="dimensions") from None
    prompts = await _input_prompts(server, body.input)
    outputs = await _pool(server, prompts, params, "input")
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(o.pooled, body.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    return {"object": "list", "data": data, "model": model, "usage": _usage(outputs)}


async def _input_prompts(server, value: Any) -> list[list[int]]:
    if isinstance(value, str):
        return await _encode(server, [value], "input")
    if not value:
        raise APIError(400, "input is empty", param="input")
    if isinstance(value[0], int):
        return [list(value)]
    if isinstance(value[0], str):
        return await _encode(server, list(value), "input")
    return [list(ids) for ids in value]


def _encoded(vector, encoding_format: str):
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _pair_scores(server, engine: PoolingEngine, queries, documents, field: str):
    """(scores, the outputs whose tokens count as usage) of each (query, document) pair."""
    try:
        pairs = score_pairs(queries, documents)
    except ValueError as exc:
        raise APIError(400, str(exc), param=field) from None
    if engine.task == "classify":
        if engine.tokenizer is None:
            raise APIError(400, f"{field}: scoring needs a tokenizer", param=field)
        template = server.config.chat_template  # --chat-template: the pairs' score template
        try:
            prompts = await asyncio.to_thread(
                lambda: [score_prompt_ids(engine, q, d, template) for q, d in pairs]
            )
        except ValueError as exc:  # the score template failed on this pair
            raise APIError(400, str(exc), param=field) from None
        outputs = await _pool(server, prompts, PoolingParams(), field)
        try:
            return [single_score(o) for o in outputs], outputs
        except ValueError as exc:
            raise APIError(400, str(exc), param="model") from None
    texts = [q for q, _ in pairs] + [d for _, d in pairs]
    outputs = await _pool(server, await _encode(server, texts, field), PoolingParams(), field)
    half = len(pairs)
    scores = [cosine(q.pooled, d.pooled) for q, d in zip(outputs[:half], outputs[half:])]
    return scores, outputs


async def _score(server, engine: PoolingEngine, body: ScoreRequest, request: Request):
    model = _model(server, body)
    queries = body.text_1 if body.text_1 is not None else body.queries
    documents, field = body.text_2, "text_2"
    if documents is None:
        documents, field = body.documents, "documents"
    if queries is None:
        raise APIError(400, "text_1 (or queries) is required", param="text_1")
    if documents is None:
        raise APIError(400, "text_2 (or documents) is required", param="text_2")
    scores, outputs = await _pair_scores(server, engine, queries, documents, field)
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(outputs),
    }


async def _rerank(server, engine: PoolingEngine, body: RerankRequest, request: Request):
    model = _model(server, body)
    if not body.documents:
        raise APIError(400, "documents is empty: give at least one document", param="documents")
    scores, outputs = await _pair_scores(server, engine, body.query, body.documents, "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": body.documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "results": results,
        # Jina's and Cohere's total_tokens, and vLLM's prompt_tokens beside it
        "usage": _usage(outputs),
    }
