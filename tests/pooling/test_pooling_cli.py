"""The pooling flags `pagedllm serve` takes: parsed into EngineArgs' keywords, bad values a usage
error."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import EngineArgs
from pagedllm.pooling.cli import add_pooling_flags, pooling_engine_kwargs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_pooling_flags(p)
    return p


def test_pooling_flags_become_engine_arguments():
    args = parser().parse_args(["--runner", "pooling", "--convert", "embed"])
    engine = EngineArgs(**pooling_engine_kwargs(args))
    assert (engine.runner, engine.convert) == ("pooling", "embed")


def test_without_flags_the_model_generates():
    assert pooling_engine_kwargs(parser().parse_args([])) == {
        "runner": "generate",
        "convert": "auto",
    }


def test_an_unknown_runner_is_a_usage_error():
    with pytest.raises(SystemExit) as caught:
        parser().parse_args(["--runner", "embedding"])
    assert caught.value.code == 2
