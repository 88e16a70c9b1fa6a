"""`--api-key` closes every route but the probes (`/health`, `/metrics`; `/load`, which names
the KV-event endpoints, is closed: a router sends its key on its polls): the routes are read off
the app, so a route added later is checked too."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.api_server import OPEN_PATHS

from server_util import MODEL, live_server

KEY = "sekret"
# a request each POST route answers 200 to (a new POST route must add its own here)
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
    },
    "/v1/responses": {"model": MODEL, "input": "x", "max_output_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [104, 105]},
}
# routes this (generating, no runtime LoRA opt-in) server answers with a client error past the
# key: the pooling routes (a 400 naming `model`) and the runtime LoRA routes (404, as vLLM's
# without the opt-in); a body each, and the status it gets
REFUSED = {
    "/v1/embeddings": ({"model": MODEL, "input": "x"}, 400),
    "/v1/score": ({"model": MODEL, "text_1": "a", "text_2": "b"}, 400),
    "/score": ({"model": MODEL, "text_1": "a", "text_2": "b"}, 400),
    "/v1/rerank": ({"model": MODEL, "query": "a", "documents": ["b"]}, 400),
    "/rerank": ({"model": MODEL, "query": "a", "documents": ["b"]}, 400),
    "/v2/rerank": ({"model": MODEL, "query": "a", "documents": ["b"]}, 400),
    "/v1/load_lora_adapter": ({"lora_name": "a", "lora_path": "/nowhere"}, 404),
    "/v1/unload_lora_adapter": ({"lora_name": "a"}, 404),
    # a JSON body where the upload is multipart
    "/v1/files": ({"purpose": "batch"}, 400),
    "/v1/batches": (
        {"input_file_id": "file-none", "endpoint": "/v1/chat/completions"},
        404,
    ),
}


@pytest.fixture(scope="module")
def server():
    with live_server(api_key=KEY) as live:
        yield live


def _requests(app):
    """(method, path, body) of every route of the app."""
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                body = BODIES.get(route.path, REFUSED.get(route.path, (None,))[0])
                yield method, route.path, body if method == "POST" else None


def _send(server, method: str, path: str, body, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)


def test_every_route_but_the_probes_is_401_without_the_key(server):
    closed = [(m, p, b) for m, p, b in _requests(server.app) if p not in OPEN_PATHS]
    assert {"/tokenize", "/detokenize", "/v1/models", "/openapi.json"} <= {p for _, p, _ in closed}
    for method, path, body in closed:
        for key in (None, "nope"):
            response = _send(server, method, path, body, key)
            assert response.status_code == 401, (method, path, key, response.text)
            assert response.json()["error"]["type"] == "authentication_error"


def test_every_route_answers_with_the_key(server):
    for method, path, body in _requests(server.app):
        named = "{" in path
        assert method != "POST" or named or body is not None, f"add a body for {path} to BODIES"
        response = _send(server, method, path, body, KEY)
        # a path naming an object (`/v1/files/{file_id}`): none by that id here
        refused = method == "POST" and path in REFUSED
        expected = 404 if "{" in path else REFUSED[path][1] if refused else 200
        assert response.status_code == expected, (method, path, response.text)


def test_the_probes_stay_open_without_the_key(server):
    assert {path for _, path, _ in _requests(server.app)} >= OPEN_PATHS
    for path in sorted(OPEN_PATHS):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 200, path


def test_a_path_with_no_route_is_401_not_404_without_the_key(server):
    assert _send(server, "GET", "/no-such-route", None, None).status_code == 401
