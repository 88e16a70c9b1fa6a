"""Fixtures of the README and docs example tests (doc_examples.py says how examples run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the entrypoint tests' live server (uvicorn in a thread over the built-in model, a free port)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))


@pytest.fixture(scope="session")
def examples_dir(tmp_path_factory):
    """The folder the examples run in: `./tiny` (with `./tiny/adapter`), `./tiny-draft` and a
    `prompts.txt`, as a reader who followed the docs' `pagedllm export-tiny` lines has."""
    from pagedllm.cli import main

    where = tmp_path_factory.mktemp("examples")
    assert main(["export-tiny", str(where / "tiny"), "--with-adapter"]) == 0
    assert main(["export-tiny", str(where / "tiny-draft"), "--num-layers", "1"]) == 0
    (where / "prompts.txt").write_text("Hello, my name is\nOnce upon a time\n")
    return where


@pytest.fixture(scope="module")
def server_url():
    """A live server of the built-in model, for the examples that talk to 127.0.0.1:8000."""
    from server_util import live_server

    with live_server() as live:
        yield live.url
