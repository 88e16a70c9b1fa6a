"""The pooling flags `pagedllm serve` takes: parsed into EngineArgs' keywords, bad values a usage
error."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.cli.flags import add_pooling_flags, pooling_engine_kwargs
from pagedllm.config import EngineArgs


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
        "hf_overrides": None,
    }


def test_hf_overrides_json_becomes_the_engine_argument():
    overrides = (
        '{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
    )
    args = parser().parse_args(["--runner", "pooling", "--hf-overrides", overrides])
    engine = EngineArgs(**pooling_engine_kwargs(args))
    assert engine.hf_overrides["classifier_from_token"] == ["no", "yes"]


def test_hf_overrides_that_are_not_a_json_object_are_a_usage_error():
    with pytest.raises(SystemExit) as caught:
        parser().parse_args(["--hf-overrides", '["no", "yes"]'])
    assert caught.value.code == 2


def test_serve_reports_an_unsupported_override_key_by_name(capsys):
    from pagedllm.cli.app import main

    argv = ["serve", "--runner", "pooling", "--hf-overrides", '{"rope_theta": 1}']
    assert main(argv) == 1
    assert "hf_overrides: key 'rope_theta' is not supported" in capsys.readouterr().err


def test_an_unknown_runner_is_a_usage_error():
    with pytest.raises(SystemExit) as caught:
        parser().parse_args(["--runner", "embedding"])
    assert caught.value.code == 2


def test_serve_passes_the_pooling_flags_to_the_engine():
    from pagedllm.cli.app import build_parser
    from pagedllm.cli.commands.serve import _engine_kwargs

    args = build_parser().parse_args(["serve", "--runner", "pooling", "--convert", "embed"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["runner"], kwargs["convert"]) == ("pooling", "embed")


def test_serve_refuses_pooling_behind_data_parallel_replicas_before_starting_them(capsys):
    from pagedllm.cli.app import main

    assert main(["serve", "--runner", "pooling", "--data-parallel-size", "2"]) == 1
    assert "runner='pooling'" in capsys.readouterr().err
