"""`router/routes.py` alone: what each forwarded route is routed by, and how a broken Responses
stream ends."""

from __future__ import annotations

import json

import pytest

from pagedllm.router.routes import routing_text, stream_failure


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/embeddings", {"input": ["first", "second"]}, "first"),
        ("/v1/embeddings", {"input": [[5, 6], [7]]}, [5, 6]),
        ("/v1/score", {"text_1": "query", "text_2": ["a", "b"]}, "query"),
        ("/v1/score", {"queries": ["q1", "q2"], "documents": ["a", "b"]}, "q1"),
        ("/v1/rerank", {"query": "query", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"documents": ["a"]}, None),
    ],
)
def test_pooling_requests_are_routed_by_what_every_pair_starts_with(path, body, expected):
    assert routing_text(path, body) == expected


def test_a_broken_responses_stream_ends_with_an_error_event():
    event = stream_failure("/v1/responses", "replica 0 failed mid-stream").decode()
    kind, data = event.strip().split("\n")
    assert kind == "event: error"
    assert json.loads(data[len("data: ") :])["type"] == "error"
    assert stream_failure("/v1/completions", "x").endswith(b"data: [DONE]\n\n")
