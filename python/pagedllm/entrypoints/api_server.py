"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) behind `pagedllm serve`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), and FastAPI's `/openapi.json`.
Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: a client's mistake
is a 4xx naming the field, an engine failure 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.async_engine import AsyncEngine, EngineDeadError
from pagedllm.entrypoints.chat import checkpoint_chat_template, encode_chat, render_chat
from pagedllm.entrypoints.metrics import ServerMetrics
from pagedllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.server")

DISCONNECT_POLL_S = 0.1


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    chat_template: str | None = None
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.headers = headers


def _error_response(
    status: int, message: str, type_: str, param: str | None = None, headers=None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    """The field an engine ValueError names ("SamplingParams.top_p must ...", "logprobs=...")."""
    match = re.search(r"SamplingParams\.(\w+)", message)
    if match:
        return match.group(1)
    for name in ("prompt", "best_of", "logprobs", "priority", "stop_token_ids", "n"):
        if re.search(rf"\b{name}\b", message):
            return name
    return None


def _bad_request(exc: Exception) -> APIError:
    message = str(exc)
    return APIError(400, message, param=_param_of(message))


# ---- building requests ----------------------------------------------------------------------


def _sampling_params(body, *, max_tokens: int | None, logprobs: int | None, vocab: int):
    if body.stop_token_ids:
        for token in body.stop_token_ids:
            if not 0 <= token < vocab:
                raise APIError(
                    400,
                    f"stop_token_ids: token id {token} is outside the vocabulary [0, {vocab})",
                    param="stop_token_ids",
                )
    kwargs: dict[str, Any] = dict(
        n=body.n,
        seed=body.seed,
        stop=body.stop,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        stop_token_ids=body.stop_token_ids,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    if getattr(body, "best_of", None) is not None:
        kwargs["best_of"] = body.best_of
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise _bad_request(exc) from None


def _prompts(body: CompletionRequest) -> list[Any]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


# ---- the app --------------------------------------------------------------------------------


class Server:
    """The app's state: the engine loop, the config, the metrics."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine)
        template = config.chat_template
        if template is None:
            args = engine.engine.args
            template = checkpoint_chat_template(engine.tokenizer, args.tokenizer or args.model)
        self.chat_template = template

    # -- checks ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves "
                f"`{self.config.served_model_name}`)",
                param="model",
                type_="NotFoundError",
            )

    def tokenize(self, prompt: Any, index: int, what: str = "prompt") -> tuple[str | None, list]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise APIError(400, f"{what}: text prompts need a tokenizer", param=what)
            tokenizer = self.engine.tokenizer
            chat = what == "messages"
            text, ids = prompt, encode_chat(tokenizer, prompt) if chat else tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise APIError(400, f"{what}[{index}] is empty", param=what)
        vocab = self.engine.engine.model_config.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise APIError(
                    400,
                    f"{what}[{index}]: token id {token} at position {i} is outside the "
                    f"vocabulary [0, {vocab})",
                    param=what,
                )
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise APIError(
                400,
                f"{what}[{index}] has {len(ids)} tokens; max_model_len is {limit}, which must "
                f"leave room for at least one generated token",
                param=what,
            )
        return text, ids

    def admit(self, num_requests: int, num_tokens: int) -> None:
        cfg = self.config
        if cfg.max_queued_requests is None and cfg.max_queued_tokens is None:
            return
        queued_requests, queued_tokens = self.engine.queued()
        over = (
            cfg.max_queued_requests is not None
            and queued_requests + num_requests > cfg.max_queued_requests
        ) or (
            cfg.max_queued_tokens is not None and queued_tokens + num_tokens > cfg.max_queued_tokens
        )
        if over:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                f"the server is overloaded: {queued_requests} requests ({queued_tokens} prompt "
                f"tokens) are queued; limits are max_queued_requests="
                f"{cfg.max_queued_requests}, max_queued_tokens={cfg.max_queued_tokens}",
                type_="rate_limit_error",
                headers={"Retry-After": "1"},
            )

    # -- running ---------------------------------------------------------------------------

    async def submit(self, prompts, params, priority) -> list[tuple[str, asyncio.Queue]]:
        """Adds one request per (text, ids) prompt; on any failure aborts those already added."""
        self.admit(len(prompts), sum(len(ids) for _, ids in prompts))
        base = uuid.uuid4().hex
        streams: list[tuple[str, asyncio.Queue]] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                request_id = f"{base}-{i}"
                prompt = {"prompt_token_ids": ids, "prompt": text}
                queue = await self.engine.add_request(
                    request_id, prompt, params, priority=priority, num_prompt_tokens=len(ids)
                )
                streams.append((request_id, queue))
        except EngineDeadError as exc:
            self.abort_all(streams)
            raise APIError(503, str(exc), type_="service_unavailable") from None
        except (ValueError, TypeError) as exc:
            self.abort_all(streams)
            raise _bad_request(exc) from None
        except BaseException:
            self.abort_all(streams)
            raise
        return streams

    def abort_all(self, streams) -> None:
        for request_id, _ in streams:
            self.engine.abort(request_id)

    async def merged(
        self, streams, timeout: float | None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as outputs arrive, until every request finished. A request
        past `timeout` is aborted (its last output has finish reason "abort")."""
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        getters: dict[asyncio.Task, int] = {}

        def watch(index: int) -> None:
            getters[asyncio.ensure_future(streams[index][1].get())] = index

        for index in range(len(streams)):
            watch(index)
        try:
            while getters:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait(
                    getters, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    if not timed_out:
                        timed_out = True
                        self.abort_all(streams)
                    deadline = None
                    continue
                for task in done:
                    index = getters.pop(task)
                    item = task.result()
                    queue = streams[index][1]
                    # outputs are cumulative: when the client fell behind, only the latest counts
                    while not queue.empty() and isinstance(item, RequestOutput):
                        if item.finished:
                            break
                        item = queue.get_nowait()
                    if isinstance(item, BaseException):
                        raise APIError(503, str(item), type_="service_unavailable")
                    if timed_out and item.finished:
                        for completion in item.outputs:
                            if completion.finish_reason == "abort":
                                completion.stop_reason = f"timeout after {timeout} s"
                    yield index, item
                    if not item.finished:
                        watch(index)
        finally:
            for task in getters:
                task.cancel()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _completion_logprobs(completion, start: int, text_offset: int) -> dict[str, Any] | None:
    """OpenAI's legacy completion logprobs of tokens [start:] of a completion."""
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token else ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        # keyed by token text, as OpenAI's are: tokens with the same text keep the likeliest
        ranked: dict[str, float] = {}
        for tid, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
            ranked.setdefault(lp.decoded_token or str(tid), lp.logprob)
        top.append(ranked)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(completion, start: int, top_n: int) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token else ""
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob if chosen is not None else None,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode("utf-8")),
                    }
                    for _, lp in ranked
                ],
            }
        )
    return {"content": content}


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _take_unsent(completion, key, sent_text: dict, sent_tokens: dict):
    """(text delta, its start, first unsent token, number of unsent tokens) of a cumulative
    completion, marked as sent; None while there is nothing to send (no text yet, e.g. half a
    UTF-8 character, no logprobs due and not finished)."""
    text_start = sent_text.get(key, 0)
    token_start = sent_tokens.get(key, 0)
    delta = completion.text[text_start:]
    new_tokens = len(completion.token_ids) - token_start
    logprobs_due = new_tokens and completion.logprobs is not None
    if not delta and completion.finish_reason is None and not logprobs_due:
        return None
    sent_text[key] = len(completion.text)
    sent_tokens[key] = len(completion.token_ids)
    return delta, text_start, token_start, new_tokens


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _ApiKeyMiddleware:
    """401 on /v1 without `Authorization: Bearer <key>` (compared in constant time). Plain ASGI:
    Starlette's BaseHTTPMiddleware would interfere with streamed responses."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error_response(
                    401, "invalid or missing API key", "authentication_error"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops `engine`'s loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    server = Server(engine, config)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = None if first.get("type") == "json_invalid" else ".".join(loc) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in errors[:5]
        )
        return _error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    if config.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return _error_response(503, "the engine loop is not running", "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pagedllm",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        params = _sampling_params(
            body,
            max_tokens=body.max_tokens if body.max_tokens is not None else 16,
            logprobs=body.logprobs,
            vocab=vocab,
        )
        prompts = [server.tokenize(p, i) for i, p in enumerate(_prompts(body))]
        streams = await server.submit(prompts, params, body.priority)
        created = int(time.time())
        cid = f"cmpl-{streams[0][0]}"
        n = params.n
        model = config.served_model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_completions(
                    server, streams, body, prompts, n, cid, created, model, include_usage
                ),
                media_type="text/event-stream",
            )
        finals = await _collect(server, streams, body.timeout, request)
        choices = []
        completion_tokens = 0
        for i, output in enumerate(finals):
            for completion in output.outputs:
                text = completion.text
                if body.echo and prompts[i][0] is not None:
                    text = prompts[i][0] + text
                completion_tokens += len(completion.token_ids)
                choices.append(
                    {
                        "index": i * n + completion.index,
                        "text": text,
                        "logprobs": _completion_logprobs(completion, 0, 0),
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top_n = body.top_logprobs or 0
        params = _sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=top_n if body.logprobs else None,
            vocab=vocab,
        )
        messages = [m.model_dump() for m in body.messages]
        try:
            text = render_chat(messages, engine.tokenizer, server.chat_template)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prompts = [server.tokenize(text, 0, "messages")]
        streams = await server.submit(prompts, params, body.priority)
        created = int(time.time())
        cid = f"chatcmpl-{streams[0][0]}"
        model = config.served_model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_chat(
                    server, streams, body, prompts, cid, created, model, include_usage, top_n
                ),
                media_type="text/event-stream",
            )
        (output,) = await _collect(server, streams, body.timeout, request)
        choices = [
            {
                "index": completion.index,
                "message": {"role": "assistant", "content": completion.text},
                "logprobs": _chat_logprobs(completion, 0, top_n),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            for completion in output.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(len(prompts[0][1]), completion_tokens),
        }

    return app


async def _collect(server: Server, streams, timeout, request: Request) -> list[RequestOutput]:
    """The final outputs; a client that disconnects first has its requests aborted."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def gather() -> None:
        async for index, output in server.merged(streams, timeout):
            if output.finished:
                finals[index] = output

    gather_task = asyncio.ensure_future(gather())
    watch_task = asyncio.ensure_future(_watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({gather_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if gather_task not in done:
            server.abort_all(streams)
            gather_task.cancel()
            return []
        gather_task.result()
        complete = [f for f in finals if f is not None]
        return complete
    finally:
        watch_task.cancel()
        if not gather_task.done():
            gather_task.cancel()
        if any(f is None for f in finals):  # disconnected or failed: abort what is left
            server.abort_all(streams)


async def _stream_completions(
    server, streams, body, prompts, n, cid, created, model, include_usage
) -> AsyncIterator[str]:
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    completion_tokens = 0
    completed = False
    try:
        async for i, output in server.merged(streams, body.timeout):
            for completion in output.outputs:
                key = (i, completion.index)
                first = key not in sent_text
                unsent = _take_unsent(completion, key, sent_text, sent_tokens)
                if unsent is None:
                    continue
                delta, text_start, token_start, new_tokens = unsent
                if first and body.echo and prompts[i][0] is not None:
                    delta = prompts[i][0] + delta
                completion_tokens += new_tokens
                choice = {
                    "index": i * n + completion.index,
                    "text": delta,
                    "logprobs": _completion_logprobs(completion, token_start, text_start),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
                yield _sse(
                    {
                        "id": cid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                )
        if include_usage:
            usage = _usage(sum(len(ids) for _, ids in prompts), completion_tokens)
            yield _sse(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            )
        yield "data: [DONE]\n\n"
        completed = True
    except APIError as exc:
        yield _sse({"error": {"message": exc.message, "type": exc.type, "code": exc.status}})
        yield "data: [DONE]\n\n"
    finally:
        if not completed:  # a disconnect cancels this generator: abort at once
            server.abort_all(streams)


async def _stream_chat(
    server, streams, body, prompts, cid, created, model, include_usage, top_n
) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    completion_tokens = 0

    def chunk(choices: list, usage=None) -> str:
        payload = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage is not None:
            payload["usage"] = usage
        return _sse(payload)

    completed = False
    try:
        for index in range(body.n):  # the role first, as OpenAI sends it
            yield chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        async for _, output in server.merged(streams, body.timeout):
            for completion in output.outputs:
                key = completion.index
                unsent = _take_unsent(completion, key, sent_text, sent_tokens)
                if unsent is None:
                    continue
                delta, _, token_start, new_tokens = unsent
                completion_tokens += new_tokens
                yield chunk(
                    [
                        {
                            "index": key,
                            "delta": {"content": delta},
                            "logprobs": _chat_logprobs(completion, token_start, top_n),
                            "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason,
                        }
                    ]
                )
        if include_usage:
            yield chunk([], _usage(len(prompts[0][1]), completion_tokens))
        yield "data: [DONE]\n\n"
        completed = True
    except APIError as exc:
        yield _sse({"error": {"message": exc.message, "type": exc.type, "code": exc.status}})
        yield "data: [DONE]\n\n"
    finally:
        if not completed:  # a disconnect cancels this generator: abort at once
            server.abort_all(streams)


def build_server_app(engine_kwargs: dict, config: ServerConfig) -> FastAPI:
    from pagedllm.config import EngineArgs
    from pagedllm.engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(**engine_kwargs))
    return build_app(AsyncEngine(engine), config)


def run_server(
    app: FastAPI, host: str, port: int, log_level: str = "info", shutdown_grace_s: float = 5.0
) -> None:
    """Serves until SIGINT/SIGTERM, then stops gracefully and returns (exit status 0): uvicorn
    stops accepting; in-flight requests get `shutdown_grace_s` seconds to finish, then are
    aborted (finish reason "abort", stop_reason "the server is shutting down") and their
    responses completed; a second SIGINT forces the exit.
    """
    import signal

    import uvicorn

    engine: AsyncEngine = app.state.server.engine

    class _Server(uvicorn.Server):
        # uvicorn re-raises a captured signal after shutting down (exit 130/143); a requested
        # stop is a clean exit here
        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signum, frame) -> None:
                if self.should_exit and signum == signal.SIGINT:
                    self.force_exit = True
                if not self.should_exit:
                    with contextlib.suppress(RuntimeError):  # no loop running: nothing in flight
                        loop = asyncio.get_running_loop()
                        loop.call_soon_threadsafe(
                            loop.call_later, shutdown_grace_s, engine.begin_shutdown
                        )
                self.should_exit = True

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_grace_s + 5,
    )
    _Server(config).run()
