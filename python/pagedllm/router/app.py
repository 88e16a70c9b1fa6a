"""The router's HTTP face: OpenAI's `/v1/completions`, `/v1/chat/completions` and
`/v1/responses` (streaming included), `/v1/embeddings`, `/v1/score` and `/v1/rerank` forwarded to
the replica the Rust core picks (`routes.py`: what the last four are routed by), the runtime
LoRA routes sent to every replica (one answer, `routes.broadcast_answer`), plus `/v1/models`,
`/tokenize` and
`/detokenize` (a live replica's), `/health` and `/metrics` (per replica, label `engine`). With an
API key every route but `/health` and `/metrics` wants `Authorization: Bearer <key>`.

Per request: the prompt's token ids, the adapter's LoRA id (from the replicas' `/load`), the
session header; then `Router.route`. Token-id prompts are hashed as given; text and chat are
rendered and tokenized here, once, with the replicas' own renderer (`entrypoints/rendering.py`:
their tokenizer, chat template and chat options, loaded from what their `/load` describes; the
request's tools and chat_template_kwargs included), and the ids go to the replica in the body's
`prompt_token_ids`, so it neither renders nor tokenizes again. A template error is the router's
400. Where no replica's renderer loads here (an external replica, model files the router cannot
see), a live replica's `/tokenize` gives the ids to hash and the replica renders itself. A
replica that cannot be reached, or answers 502/503, is taken out of rotation and the request
goes to another; so does a request whose replica stops answering (its /load silent for
`unresponsive_after`) before the client got a byte (a stream's first event is read before the
client is answered). A replica that breaks off before the first byte is a 502. A stream that
breaks, or whose replica stops answering, after its first byte ends with an error event
(OpenAI's `{"error": {...}}`) and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from pagedllm._core import PagedLLMError
from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.protocol import ChatCompletionRequest
from pagedllm.entrypoints.rendering import Renderer
from pagedllm.router.replicas import InFlight, Replica, ReplicaDown, ReplicaSet
from pagedllm.router.routes import (
    BROADCAST_ROUTES,
    PROMPT_ROUTES,
    broadcast_answer,
    routing_ids,
    routing_text,
    stream_failure,
)

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
# names the replica that served a response (tests, debugging)
REPLICA_HEADER = "x-pagedllm-replica"
# the client's headers a replica needs (the API key, the content type)
FORWARDED_HEADERS = ("authorization", "content-type")
RETRY_STATUSES = (502, 503)
# open without the API key: what probes and scrapers read
OPEN_PATHS = ("/health", "/metrics")


def error(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": status}}, status_code=status
    )


def check_api_key(api_key: str | None) -> None:
    """ValueError for an empty key (an unset variable in `--api-key "$KEY"`) or one with
    whitespace around it, as `serve` refuses them (its check is not imported: it loads torch)."""
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise ValueError(
            "the router's API key is empty or has whitespace around it; give it plainly, or "
            "none to route without authentication"
        )


class _ApiKeyMiddleware:
    """401 without `Authorization: Bearer <key>` (compared in constant time) on every path but
    OPEN_PATHS. Plain ASGI: Starlette's BaseHTTPMiddleware would interfere with streams."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error(401, "invalid or missing API key", "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Collector:
    """Per-replica figures (label `engine`, as vLLM's data-parallel metrics)."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self):
        stats = self.replicas.stats()
        families = {
            "routed": CounterMetricFamily(
                "pagedllm_router:routed_requests", "Requests routed", labels=["engine"]
            ),
            "hit_blocks": CounterMetricFamily(
                "pagedllm_router:prefix_hit_blocks",
                "Prompt blocks the index found on the chosen replica",
                labels=["engine"],
            ),
            "query_blocks": CounterMetricFamily(
                "pagedllm_router:prefix_query_blocks",
                "Prompt blocks eligible for reuse, over the routed requests",
                labels=["engine"],
            ),
            "in_flight": GaugeMetricFamily(
                "pagedllm_router:requests_in_flight", "Requests under way", labels=["engine"]
            ),
        }
        hit_rate = GaugeMetricFamily(
            "pagedllm_router:prefix_hit_rate",
            "Prompt tokens served from the replica's prefix cache / prompt tokens (from usage)",
            labels=["engine"],
        )
        cached = CounterMetricFamily(
            "pagedllm_router:cached_prompt_tokens",
            "Prompt tokens served from the replica's prefix cache (from usage)",
            labels=["engine"],
        )
        prompt = CounterMetricFamily(
            "pagedllm_router:prompt_tokens", "Prompt tokens (from usage)", labels=["engine"]
        )
        up = GaugeMetricFamily(
            "pagedllm_router:replica_up", "In rotation (1) or not (0)", labels=["engine"]
        )
        restarts = CounterMetricFamily(
            "pagedllm_router:replica_restarts",
            "New instances of the replica seen (restarted by its supervisor or `serve -dp`)",
            labels=["engine"],
        )
        malformed = CounterMetricFamily(
            "pagedllm_router:kv_events_malformed",
            "KV-event messages from the replica skipped as malformed",
            labels=["engine"],
        )
        subscriber_restarts = CounterMetricFamily(
            "pagedllm_router:kv_event_subscriber_restarts",
            "Times the replica's KV-event subscriber failed and was started again",
            labels=["engine"],
        )
        dropped = CounterMetricFamily(
            "pagedllm_router:index_dropped_blocks",
            "Stored blocks left out of the index past the replica's bound",
            labels=["engine"],
        )
        for replica, s in zip(self.replicas.replicas, stats):
            label = [str(replica.index)]
            sub = replica.subscriber
            malformed.add_metric(label, sub.malformed if sub is not None else 0)
            subscriber_restarts.add_metric(label, sub.restarts if sub is not None else 0)
            dropped.add_metric(label, s["dropped_blocks"])
            for key, family in families.items():
                family.add_metric(label, s[key])
            cached.add_metric(label, replica.cached_tokens)
            prompt.add_metric(label, replica.prompt_tokens)
            hit_rate.add_metric(label, replica.cached_tokens / max(replica.prompt_tokens, 1))
            up.add_metric(label, 1.0 if replica.alive else 0.0)
            restarts.add_metric(label, replica.restarts)
        yield from families.values()
        yield from (hit_rate, cached, prompt, up, restarts)
        yield from (malformed, subscriber_restarts, dropped)


def build_router_app(
    replicas: ReplicaSet,
    *,
    session_header: str = SESSION_HEADER,
    request_timeout: float = 600.0,
    api_key: str | None = None,
) -> FastAPI:
    """`api_key`: wanted from clients on every path but OPEN_PATHS (None: open)."""
    check_api_key(api_key)
    client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=2.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await replicas.poll(client)  # who is there before the first request
        replicas.start(client)
        try:
            yield
        finally:
            await replicas.stop()
            await client.aclose()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    app.state.replicas = replicas
    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    registry = CollectorRegistry()
    registry.register(_Collector(replicas))

    @app.get("/health")
    async def health():
        if not replicas.live():
            return error(503, "no replica is in rotation", "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return await _any_replica(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _any_replica(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _any_replica(request, "POST", "/detokenize")

    async def _any_replica(request: Request, method: str, path: str) -> Response:
        """The first live replica's answer to the request (they all answer alike)."""
        raw = await request.body()
        for replica in replicas.live():
            try:
                r = await _ask(replica, method, path, raw, _headers(request))
            except (httpx.HTTPError, ReplicaDown):
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error(503, "no replica answers", "service_unavailable")

    async def _ask(
        replica: Replica, method: str, path: str, raw: bytes, headers: dict
    ) -> httpx.Response:
        """One short call to `replica`, ended (ReplicaDown) if it stops answering meanwhile."""
        with replicas.watch(replica) as in_flight, in_flight.waiting():
            return await client.request(
                method, f"{replica.url}{path}", content=raw, headers=headers
            )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _proxy(request, "/v1/chat/completions")

    def _proxy_to(path: str):
        async def proxy(request: Request):
            return await _proxy(request, path)

        return proxy

    for path in PROMPT_ROUTES:  # Responses, pooling: routed by their prompt like completions
        app.add_api_route(path, _proxy_to(path), methods=["POST"])

    def _broadcast_to(path: str):
        async def broadcast(request: Request):
            raw, headers = await request.body(), _headers(request)

            async def one(replica: Replica) -> tuple[int, int | None, bytes, str | None]:
                if not replica.alive:
                    return replica.index, None, b"out of rotation", None
                try:
                    r = await _ask(replica, "POST", path, raw, headers)
                except (httpx.HTTPError, ReplicaDown) as exc:
                    return replica.index, None, f"not reached ({exc!r})".encode(), None
                return replica.index, r.status_code, r.content, r.headers.get("content-type")

            answers = await asyncio.gather(*(one(r) for r in replicas.replicas))
            status, content, own = broadcast_answer(path, [a[:3] for a in answers])
            media = answers[0][3] if own else "application/json"
            return Response(content, status_code=status, media_type=media)

        return broadcast

    for path in BROADCAST_ROUTES:  # runtime LoRA: every replica serves the same adapters
        app.add_api_route(path, _broadcast_to(path), methods=["POST"])

    async def _proxy(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return error(400, f"the request body is not valid JSON ({exc})")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        try:
            prompt = await _prompt(path, body, raw, request)
        except APIError as exc:  # the template failed on the request
            return exc.response()
        lora_id = _lora_id(body.get("model"))
        session = request.headers.get(session_header)
        excluded = 0
        while True:
            try:
                replica, ticket = replicas.route(prompt.tokens, lora_id, session, excluded)
            except PagedLLMError:
                return error(503, "no replica is in rotation", "service_unavailable")
            excluded |= 1 << replica.index
            sent = prompt.body_for(replica)
            answer = await _forward(replicas.track(replica, ticket), path, sent, request, body)
            if answer is not None:
                return answer

    async def _forward(
        in_flight: InFlight, path: str, raw: bytes, request: Request, body: dict
    ) -> Response | None:
        """The replica's answer for the client, or None for "try another": it answered 502/503
        or could not be reached (it leaves rotation), or it stopped answering before the first
        byte (a stream's first event is read before the client is answered, so that holds for
        streams too). Releases `in_flight`, or hands it to the stream."""
        replica = in_flight.replica
        response = None
        try:
            sent = client.build_request(
                "POST", f"{replica.url}{path}", content=raw, headers=_headers(request)
            )
            try:
                with in_flight.waiting():
                    response = await client.send(sent, stream=True)
            except httpx.TransportError as exc:  # never reached it
                replicas.mark_down(replica, repr(exc))
                return None
            if response.status_code in RETRY_STATUSES:
                replicas.mark_down(replica, f"answered {response.status_code}")
                return None
            headers = {REPLICA_HEADER: str(replica.index)}
            if body.get("stream") and response.status_code == 200:
                chunks = response.aiter_raw()
                with in_flight.waiting():
                    first = await anext(chunks, b"")
                stream = _stream(in_flight, first, chunks, response, path)
                settle = _settler(in_flight, response)
                in_flight = response = None  # the stream's to release
                return _SettledStream(stream, settle, headers=headers)
            with in_flight.waiting():
                content = await response.aread()
            _count_usage(replica, content)
            return Response(
                content,
                status_code=response.status_code,
                media_type=response.headers.get("content-type"),
                headers=headers,
            )
        except ReplicaDown:
            return None
        except httpx.TransportError as exc:  # broke off mid-answer: maybe the request's doing
            replicas.mark_down(replica, repr(exc))
            return error(502, f"replica {replica.index} failed mid-response", "bad_gateway")
        finally:
            if response is not None:
                await response.aclose()
            if in_flight is not None:
                replicas.release(in_flight)

    def _settler(in_flight: InFlight, response: httpx.Response):
        """What a stream's end must do even if its generator never ran (the client left
        before the first chunk was sent): close the replica's response, release the request."""

        async def settle() -> None:
            await response.aclose()
            replicas.release(in_flight)

        return settle

    async def _stream(
        in_flight: InFlight,
        first: bytes,
        chunks: AsyncIterator[bytes],
        response: httpx.Response,
        path: str,
    ) -> AsyncIterator[bytes]:
        """The replica's stream to the client from its `first` chunk (read already); releases
        `in_flight` when it ends."""
        replica = in_flight.replica
        last = first if b'"usage"' in first else b""
        failure = None
        try:
            if first:
                yield first
            while True:
                with in_flight.waiting():  # never around a yield (see InFlight.waiting)
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                last = chunk if b'"usage"' in chunk else last
                yield chunk
        except httpx.TransportError as exc:
            replicas.mark_down(replica, repr(exc))
            failure = f"replica {replica.index} failed mid-stream: {exc!r}"
        except ReplicaDown:
            failure = f"replica {replica.index} stopped answering mid-stream"
        finally:
            await response.aclose()
            replicas.release(in_flight)
            _count_usage(replica, last)
        if failure is not None:
            yield stream_failure(path, failure)

    async def _prompt(path: str, body: dict, raw: bytes, request: Request) -> _Prompt:
        """The prompt's token ids as the replicas run it (the first prompt of a batch); [] when
        they cannot be had (the replica will answer the request's error itself)."""
        if path in PROMPT_ROUTES:  # the body goes as it is; its ids only pick the replica
            return _Prompt(await _routing_ids(path, body, request), raw)
        given = body.get("prompt_token_ids")  # a client's own, run as they are
        prompt = body.get("prompt") if given is None else given
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return _Prompt(prompt, raw)
        found = replicas.renderer()
        if found is None:
            return _Prompt(await _tokenize(body, request), raw)
        renderer, key = found
        rendered = await asyncio.to_thread(render_prompt, renderer, path, body)
        if rendered is None:
            return _Prompt([], raw)
        tokens, field = rendered
        forwarded = json.dumps({**body, "prompt_token_ids": field}).encode()
        return _Prompt(tokens, raw, key, forwarded)

    async def _routing_ids(path: str, body: dict, request: Request) -> list[int]:
        found = replicas.renderer()
        if found is not None:
            return await asyncio.to_thread(routing_ids, found[0], path, body)
        given = routing_text(path, body)
        if isinstance(given, str):
            return await _tokenize({"model": body.get("model"), "prompt": given}, request)
        return given or []

    async def _tokenize(body: dict, request: Request) -> list[int]:
        """The prompt's ids from a live replica's /tokenize (no renderer loaded here)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            query = {"model": body.get("model"), "prompt": prompt}
        elif isinstance(body.get("messages"), list):
            query = {"model": body.get("model"), "messages": body["messages"]}
            for name in ("tools", "chat_template_kwargs"):  # vLLM's /tokenize takes them
                if body.get(name) is not None:
                    query[name] = body[name]
        else:
            return []
        raw, headers = json.dumps(query).encode(), _headers(request)
        headers["content-type"] = "application/json"
        for replica in replicas.live():
            try:
                r = await _ask(replica, "POST", "/tokenize", raw, headers)
            except (httpx.HTTPError, ReplicaDown):
                continue
            return r.json().get("tokens", []) if r.status_code == 200 else []
        return []

    def _lora_id(model) -> int:
        for replica in replicas.replicas:
            if model in replica.lora_ids:
                return replica.lora_ids[model]
        return 0

    return app


def run_router(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Serves until SIGINT/SIGTERM, then returns 0 (uvicorn would re-raise the signal and kill
    this process before `serve -dp` stops its replicas)."""
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            def stop(signum, frame) -> None:
                self.force_exit = self.should_exit and signum == signal.SIGINT
                self.should_exit = True

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
    return 0


class _SettledStream(StreamingResponse):
    """An event stream that runs `settle` once it is over however it ended: sent whole, the
    client gone mid-stream, or gone before it began (then the generator never starts, so its
    own `finally` never runs, and Starlette skips background tasks on a disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], settle, *, headers: dict) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._settle = settle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._settle()


@dataclass
class _Prompt:
    """A request's token ids to route by, its body as the client sent it, and (rendered here)
    its body with the ids for the replicas whose renderer is the one that rendered it (`key`)."""

    tokens: list[int]
    raw: bytes
    key: str | None = None
    forwarded: bytes | None = None

    def body_for(self, replica: Replica) -> bytes:
        """With the ids for a replica that renders as the router did and takes a body that
        large; else as the client sent it (the replica renders it itself)."""
        if self.key is None or replica.renderer_key != self.key:
            return self.raw
        limit = replica.max_body_bytes
        return self.raw if limit is not None and len(self.forwarded) > limit else self.forwarded


def render_prompt(renderer: Renderer, path: str, body: dict) -> tuple[list[int], list] | None:
    """(the ids to route by, the body's `prompt_token_ids`) of a request, rendered and tokenized
    as its replica would; None for a body the replica will refuse (it answers the error).
    APIError (a 400) when the chat template fails on it."""
    if path == "/v1/chat/completions":
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError:
            return None
        ids = renderer.chat_ids(chat)
        return ids, ids
    prompt = body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
        return None
    ids = [renderer.encode(text) for text in texts]
    return ids[0], ids


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _count_usage(replica: Replica, content: bytes) -> None:
    """Adds a response's (or the last streamed usage chunk's) prompt and cached tokens."""
    if not content:
        return
    text = content.decode(errors="replace")
    if text.lstrip().startswith(("data:", "event:")):  # an event stream: its last usage
        lines = [line for block in text.split("\n\n") for line in block.splitlines()]
        blocks = [line[5:].strip() for line in lines if line.startswith("data:")]
        text = next((b for b in reversed(blocks) if '"usage"' in b), "")
    try:
        answer = json.loads(text)
        # a Responses answer (or its response.completed event) says input_tokens
        usage = answer.get("usage") or (answer.get("response") or {}).get("usage") or {}
    except (ValueError, AttributeError):
        return
    replica.prompt_tokens += int(usage.get("prompt_tokens", usage.get("input_tokens")) or 0)
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details")) or {}
    replica.cached_tokens += int(details.get("cached_tokens") or 0)
