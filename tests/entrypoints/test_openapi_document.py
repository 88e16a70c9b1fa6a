"""The served OpenAPI document says what the server does: client errors are OpenAI-shaped 4xx
answers (400, never FastAPI's default 422), `/health` and `/metrics` are not JSON, optional
fields take null, and a wrong method gets 405 with `Allow` listing the documented ones."""

from __future__ import annotations

import httpx
import pytest

from server_util import MODEL

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def document(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json", timeout=10).json()


def _operations(document: dict):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def _documented(operation: dict, status: int) -> dict:
    """The response the document gives for `status`: its code, else its range (4XX)."""
    responses = operation["responses"]
    for key in (str(status), f"{str(status)[0]}XX", "default"):
        if key in responses:
            return responses[key]
    raise AssertionError(f"status {status} is not documented (documented: {sorted(responses)})")


def _media_type(response: httpx.Response) -> str | None:
    value = response.headers.get("content-type")
    return value.split(";")[0].strip() if value else None


def _assert_answer_is_documented(document: dict, path: str, method: str, response) -> None:
    documented = _documented(document["paths"][path][method], response.status_code)
    content = documented.get("content")
    if content is None:
        assert response.content == b"", (path, response.headers)
    else:
        assert _media_type(response) in content, (path, response.headers, sorted(content))


def test_no_operation_documents_422(document):
    for path, method, operation in _operations(document):
        assert "422" not in operation["responses"], (path, method)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_generating_operations_document_openai_errors(document):
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        for status in ("4XX", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == ERROR_REF


def test_error_schema_is_openai_shaped(document):
    detail = document["components"]["schemas"]["ErrorDetail"]
    assert set(detail["properties"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
        ("/v1/chat/completions", {"messages": []}),
    ],
)
def test_client_error_answers_are_documented(server, document, path, body):
    response = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=30)
    assert 400 <= response.status_code < 500
    _assert_answer_is_documented(document, path, "post", response)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/load"])
def test_get_answers_are_documented(server, document, path):
    response = httpx.get(f"{server.url}{path}", timeout=10)
    assert response.status_code == 200
    _assert_answer_is_documented(document, path, "get", response)


def test_metrics_are_documented_as_text(document):
    content = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]


def test_health_documents_its_503(document):
    responses = document["paths"]["/health"]["get"]["responses"]
    assert responses["503"]["content"]["application/json"]["schema"] == ERROR_REF
    assert "content" not in responses["200"]


@pytest.mark.parametrize("name", ["n", "presence_penalty", "min_tokens", "stop", "logprobs"])
def test_optional_fields_are_documented_nullable(document, name):
    field = document["components"]["schemas"]["CompletionRequest"]["properties"][name]
    assert {"type": "null"} in field["anyOf"]


def test_wrong_method_is_405_with_allow_listing_the_documented_methods(server, document):
    for path, methods in document["paths"].items():
        response = httpx.request("DELETE", f"{server.url}{path}", timeout=10)
        assert response.status_code == 405, path
        allowed = {m.strip() for m in response.headers["allow"].split(",")}
        # Starlette answers HEAD wherever GET is served; the document leaves it implicit
        assert allowed - {"HEAD"} == {m.upper() for m in methods}, path
        assert response.json()["error"]["code"] == 405
