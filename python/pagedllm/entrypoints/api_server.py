"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) behind `pagedllm serve`: the routes,
the API-key check, and running until a signal.

Endpoints: `POST /v1/completions` (serving_completions.py), `POST /v1/chat/completions`
(serving_chat.py), `POST /v1/responses` (responses.py), `GET /v1/models`, vLLM's `POST /tokenize`
and `POST /detokenize` (serving.py), `GET /health`, `GET /metrics` (Prometheus), `GET /load` (what
a data-parallel router reads: queue lengths, KV usage, where the KV events are published), and
FastAPI's `/openapi.json`; vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(lora_routes.py). What the generating endpoints share lives in serving.py; errors in errors.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from pagedllm.entrypoints.async_engine import AsyncEngine
from pagedllm.entrypoints.batches import register_batch_routes
from pagedllm.entrypoints.errors import APIError, ErrorResponse, install_error_handlers, unavailable
from pagedllm.entrypoints.lora_routes import register_lora_routes
from pagedllm.entrypoints.pooling_routes import register_pooling_routes
from pagedllm.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.responses import register_responses_route
from pagedllm.entrypoints.serving import Server, ServerConfig
from pagedllm.entrypoints.serving_chat import create_chat_completion
from pagedllm.entrypoints.serving_completions import create_completion

__all__ = ["ServerConfig", "build_app", "build_server_app", "check_api_key", "run_server"]

# What the OpenAPI document says the routes answer besides 200. A client error is documented as
# "4XX" (400 for a bad field, 401, 404, 405, 429, ...), which also stands in for FastAPI's
# default 422 that this server never answers.
_ERROR = {"model": ErrorResponse}
_CLIENT_ERROR = {"4XX": {**_ERROR, "description": "A client error (400: a bad field, named)"}}
_UNAVAILABLE = {503: {**_ERROR, "description": "The engine keeps failing or is shutting down"}}
# one server-sent event of a stream (OpenAPI before 3.2: `schema` describes each event)
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}},
    "required": ["data"],
}
_GENERATION = {
    200: {
        "description": "The completion; with `stream`, server-sent events ending in `data: [DONE]`",
        "content": {"application/json": {}, "text/event-stream": {"schema": _SSE_EVENT}},
    },
    **_CLIENT_ERROR,
    **_UNAVAILABLE,
}


def check_api_key(api_key: str | None) -> None:
    """ValueError for an empty key (an unset variable in `--api-key "$KEY"`, which must not
    silently serve without authentication) or one with whitespace around it (a slip: HTTP drops
    a header's trailing whitespace, so such a key would refuse every client)."""
    if api_key is None:
        return
    if not api_key.strip():
        raise ValueError(
            "the API key is empty (an unset variable?); give a key, or none to serve without "
            "authentication"
        )
    if api_key != api_key.strip():
        raise ValueError("the API key starts or ends with whitespace; give it without")


# what stays open with --api-key: the probes of supervisors and Prometheus. Every other path, a
# future route included, is closed (an allow-list of open paths, not a list of closed ones);
# /load too: it names the KV-event endpoints, and a router sends its key on its polls.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class _ApiKeyMiddleware:
    """401 without `Authorization: Bearer <key>` (compared in constant time) on every path but
    OPEN_PATHS. Plain ASGI: Starlette's BaseHTTPMiddleware would interfere with streamed
    responses."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key", type_="authentication_error")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: by its Content-Length before a byte is read, or
    counted as it arrives (chunked), so an oversized body is never buffered whole, parsed or
    tokenized. The body read is then handed to the app. Plain ASGI, like _ApiKeyMiddleware."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(f"{int(declared)} bytes", scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(f"over {self.max_bytes} bytes", scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _too_large(self, size: str, scope, receive, send) -> None:
        error = APIError(
            413,
            f"the request body is too large ({size}); this server takes at most "
            f"{self.max_bytes} bytes (--max-request-body-bytes)",
            type_="request_too_large",
        )
        await error.response()(scope, receive, send)


def _replay(messages: list, receive):
    """`receive` that first returns `messages`, then the client's own messages."""

    async def replayed():
        return messages.pop(0) if messages else await receive()

    return replayed


def freeze_heap() -> None:
    """Moves every object alive now out of the cyclic garbage collector's reach (`gc.freeze`),
    as vLLM's server does after start-up. A loaded engine (torch, the model, the tokenizer)
    holds ~330K tracked objects: each full collection walks them all (0.1-0.3 s on a 2-core
    machine), and the collections that a server's per-request objects trigger land inside
    steps as latency spikes. What an earlier freeze kept is unfrozen and collected first, so
    garbage is never frozen (a server started again in the same process frees the last one's)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops `engine`'s loop."""
    check_api_key(config.api_key)
    server = Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        freeze_heap()  # the engine's, FastAPI's, pydantic's and uvicorn's start-up objects
        try:
            yield
        finally:
            await engine.stop()
            server.shutdown()
            gc.unfreeze()  # the stopped server's objects can be freed again

    app = FastAPI(title="pagedllm", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    # first: on a pooling server its refusals of the generating routes win the match
    register_pooling_routes(app, server)
    if config.api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=config.api_key)
    # outermost: nothing reads a body before its size is known
    app.add_middleware(_BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "The engine loop is running (empty body)"},
            **_UNAVAILABLE,
        },
    )
    async def health():
        reason = engine.unhealthy_reason
        if reason is not None:
            return unavailable(reason).response()
        return Response(status_code=200)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format"}},
    )
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/load", responses={200: {"description": "Load and KV-event endpoints (JSON)"}})
    async def load():
        return server.load_report()

    @app.get("/v1/models", responses=_CLIENT_ERROR)
    async def models():
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pagedllm",
            "max_model_len": engine.max_model_len,
        }
        # each --lora-modules adapter is a model of its own, its parent the base model
        cards = [card] + [
            {**card, "id": name, "root": lora.lora_path, "parent": config.served_model_name}
            for name, lora in server.loras.items()
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions", responses=_GENERATION)
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions", responses=_GENERATION)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(server, body, request)

    register_responses_route(app, server)  # POST /v1/responses (responses.py)
    register_lora_routes(app, server)  # adapters loaded at run time (lora_routes.py)
    register_batch_routes(app, server)  # /v1/files and /v1/batches (batches.py)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_CLIENT_ERROR)
    async def tokenize(body: TokenizeRequest):
        return await server.prompts.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_CLIENT_ERROR)
    async def detokenize(body: DetokenizeRequest):
        return await server.prompts.detokenize(body)

    return app


def build_server_app(engine_kwargs: dict, config: ServerConfig) -> FastAPI:
    from pagedllm.config import EngineArgs
    from pagedllm.pooling import build_engine

    check_api_key(config.api_key)  # before a model is loaded for nothing
    engine = build_engine(EngineArgs.from_kwargs(**engine_kwargs))  # runner= picks it
    return build_app(AsyncEngine(engine), config)


def run_server(
    app: FastAPI, host: str, port: int, log_level: str = "info", shutdown_grace_s: float = 5.0
) -> int:
    """Serves until SIGINT/SIGTERM, then stops gracefully and returns the exit status 0: uvicorn
    stops accepting; in-flight requests get `shutdown_grace_s` seconds to finish, then are
    aborted (finish reason "abort", stop_reason "the server is shutting down") and their
    responses completed; a second SIGINT forces the exit.

    An engine that broke for good (see AsyncEngine) stops the server the same way, and the exit
    status is 1: a process that refuses every request must not stay up, a supervisor restarts it.
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
    server = _Server(config)
    engine.on_dead.append(lambda: setattr(server, "should_exit", True))
    server.run()
    return 1 if engine.dead else 0
