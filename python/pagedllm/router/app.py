"""The router's HTTP face: OpenAI's `/v1/completions` and `/v1/chat/completions` (streaming
included) forwarded to the replica the Rust core picks, plus `/v1/models`, `/health` and
`/metrics` (per replica, label `engine`).

Per request: the prompt's token ids (token-id prompts as given, text and chat through a live
replica's `/tokenize`, so the chat template and special tokens are exactly the replicas'), the
adapter's LoRA id (from the replicas' `/load`), the session header; then `Router.route`. A
replica that cannot be reached, or answers 502/503 before anything was sent to the client, is
taken out of rotation and the request goes to another; a stream that breaks after its first
byte ends with an error event (OpenAI's `{"error": {...}}`) and `[DONE]`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm._core import PagedLLMError
from pagedllm.router.replicas import Replica, ReplicaSet

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
# names the replica that served a response (tests, debugging)
REPLICA_HEADER = "x-pagedllm-replica"
# the client's headers a replica needs (the API key, the content type)
FORWARDED_HEADERS = ("authorization", "content-type")
RETRY_STATUSES = (502, 503)


def error(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "code": status}}, status_code=status
    )


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
        for replica, s in zip(self.replicas.replicas, stats):
            label = [str(replica.index)]
            for key, family in families.items():
                family.add_metric(label, s[key])
            cached.add_metric(label, replica.cached_tokens)
            prompt.add_metric(label, replica.prompt_tokens)
            hit_rate.add_metric(label, replica.cached_tokens / max(replica.prompt_tokens, 1))
            up.add_metric(label, 1.0 if replica.alive else 0.0)
        yield from families.values()
        yield from (hit_rate, cached, prompt, up)


def build_router_app(
    replicas: ReplicaSet, *, session_header: str = SESSION_HEADER, request_timeout: float = 600.0
) -> FastAPI:
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
        for replica in replicas.live():
            try:
                r = await client.get(f"{replica.url}/v1/models", headers=_headers(request))
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error(503, "no replica answers", "service_unavailable")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _proxy(request, "/v1/chat/completions")

    async def _proxy(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return error(400, f"the request body is not valid JSON ({exc})")
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        tokens = await _prompt_tokens(body, request)
        lora_id = _lora_id(body.get("model"))
        session = request.headers.get(session_header)
        excluded = 0
        while True:
            try:
                replica, ticket = replicas.route(tokens, lora_id, session, excluded)
            except PagedLLMError:
                return error(503, "no replica is in rotation", "service_unavailable")
            excluded |= 1 << replica.index
            sent = client.build_request(
                "POST", f"{replica.url}{path}", content=raw, headers=_headers(request)
            )
            try:
                response = await client.send(sent, stream=True)
            except httpx.TransportError as exc:  # never reached it: another replica
                replicas.finish(ticket)
                replicas.mark_down(replica, repr(exc))
                continue
            if response.status_code in RETRY_STATUSES:
                await response.aclose()
                replicas.finish(ticket)
                replicas.mark_down(replica, f"answered {response.status_code}")
                continue
            if body.get("stream") and response.status_code == 200:
                return StreamingResponse(
                    _stream(replica, ticket, response),
                    media_type="text/event-stream",
                    headers={REPLICA_HEADER: str(replica.index)},
                )
            try:
                content = await response.aread()
            except httpx.TransportError as exc:
                replicas.finish(ticket)
                replicas.mark_down(replica, repr(exc))
                return error(502, f"replica {replica.index} failed mid-response", "bad_gateway")
            finally:
                await response.aclose()
            replicas.finish(ticket)
            _count_usage(replica, content)
            return Response(
                content,
                status_code=response.status_code,
                media_type=response.headers.get("content-type"),
                headers={REPLICA_HEADER: str(replica.index)},
            )

    async def _stream(
        replica: Replica, ticket: int, response: httpx.Response
    ) -> AsyncIterator[bytes]:
        last = b""
        try:
            async for chunk in response.aiter_raw():
                last = chunk if b'"usage"' in chunk else last
                yield chunk
        except httpx.TransportError as exc:
            replicas.mark_down(replica, repr(exc))
            event = {
                "error": {
                    "message": f"replica {replica.index} failed mid-stream: {exc!r}",
                    "type": "bad_gateway",
                    "code": 502,
                }
            }
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await response.aclose()
            replicas.finish(ticket)
            _count_usage(replica, last)

    async def _prompt_tokens(body: dict, request: Request) -> list[int]:
        """The prompt's token ids as the replicas tokenize it (the first prompt of a batch);
        [] when they cannot be had (the replica will answer the request's error itself)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            query = {"model": body.get("model"), "prompt": prompt}
        elif isinstance(body.get("messages"), list):
            query = {"model": body.get("model"), "messages": body["messages"]}
        else:
            return []
        for replica in replicas.live():
            try:
                r = await client.post(
                    f"{replica.url}/tokenize", json=query, headers=_headers(request)
                )
            except httpx.HTTPError:
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


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


def _count_usage(replica: Replica, content: bytes) -> None:
    """Adds a response's (or the last streamed usage chunk's) prompt and cached tokens."""
    if not content:
        return
    text = content.decode(errors="replace")
    if text.lstrip().startswith("data:"):
        blocks = [b[5:].strip() for b in text.split("\n\n") if b.strip().startswith("data:")]
        text = next((b for b in reversed(blocks) if '"usage"' in b), "")
    try:
        usage = json.loads(text).get("usage") or {}
    except (ValueError, AttributeError):
        return
    replica.prompt_tokens += int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    replica.cached_tokens += int(details.get("cached_tokens") or 0)
