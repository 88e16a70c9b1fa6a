"""Fuzz the served OpenAPI schema (schemathesis's strategies, driven by Hypothesis directly): no
input makes the server answer 5xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")


def test_no_generated_input_gets_a_server_error(server):
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
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
