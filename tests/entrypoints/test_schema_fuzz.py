"""Fuzz the served OpenAPI schema (schemathesis's strategies, driven by Hypothesis directly): no
input makes the server answer 5xx, every answer is one the document gives (status, media type,
body schema), and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.specs.openapi.checks import (  # noqa: E402 - after the importorskip
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)


def _operations(server):
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    return operations


def test_no_generated_input_gets_a_server_error(server):
    operations = _operations(server)
    seen: list[int] = []

    @given(case=st.one_of([op.as_strategy() for op in operations]))
    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=server.url, timeout=30)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

    fuzz()
    assert any(400 <= status < 500 for status in seen)  # the fuzzer did send bad inputs
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()


def test_every_generated_answer_is_documented(server):
    operations = _operations(server)
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    seen: set[int] = set()

    @given(case=st.one_of([op.as_strategy() for op in operations]))
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=server.url, timeout=30)
        seen.add(response.status_code)
        case.validate_response(response, checks=checks)

    fuzz()
    assert {200, 400} <= seen  # both kinds of answer were checked
    server.wait_idle()
