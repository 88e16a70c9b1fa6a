"""Fixtures of the entrypoint tests: one live server per module (see server_util.py)."""

from __future__ import annotations

import pytest

from server_util import live_server


@pytest.fixture(scope="module")
def server():
    with live_server() as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
