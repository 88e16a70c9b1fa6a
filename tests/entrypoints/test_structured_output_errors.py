"""Constraints that compile but cannot be served, and min_tokens under a constraint: a short 400
naming the field before anything is queued (they used to answer 200 with an `abort` and a
50 KB engine dump, or with output the constraint does not allow); a long choice list is
served."""

from __future__ import annotations

import httpx
import pytest

from server_util import MODEL


def _complete(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "answer", **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            {"json": {"properties": {f"p{i}": {} for i in range(2000)}}},
            "JSON schema too large or complex for the grammar engine",
        ),
        ({"regex": "a{1000000}"}, "regex too large or complex for the grammar engine"),
        ({"json": {"$ref": "#"}}, "invalid JSON schema: no output satisfies it"),
        ({"regex": "\\"}, "invalid regex: '\\\\' ends in an unfinished escape"),
    ],
)
def test_unservable_constraints_are_a_short_400(server, constraint, message):
    response = _complete(server, max_tokens=8, structured_outputs=constraint)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and len(error["message"]) < 500
    assert error["param"] == "structured_outputs"
    server.wait_idle()


def test_min_tokens_with_a_constraint_is_a_400_naming_min_tokens(server):
    response = _complete(
        server, max_tokens=20, min_tokens=10, structured_outputs={"choice": ["yes", "no"]}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "min_tokens"
    assert "must be 0 with structured_outputs" in error["message"]


def test_a_choice_list_of_2000_items_is_served(server):
    choices = [f"item {i}" for i in range(2000)]
    response = _complete(server, max_tokens=16, structured_outputs={"choice": choices})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] in choices and choice["finish_reason"] == "stop"
