"""`--kv-offloading-size`, `--kv-offloading-backend`, `--kv-offloading-path`: parsed into
EngineArgs (vLLM's names), defaults the engine's, a bad backend refused naming the flag."""

from __future__ import annotations

import pytest

import pagedllm.cli.app
from pagedllm import EngineArgs


def test_offloading_flags_default_to_the_engine_args():
    args = pagedllm.cli.app.build_parser().parse_args(["generate", "x"])
    kwargs = pagedllm.cli.app._engine_kwargs(args)
    defaults = EngineArgs()
    for name in ("kv_offloading_size", "kv_offloading_backend", "kv_offloading_path"):
        assert kwargs[name] == getattr(defaults, name), name


def test_offloading_flags_reach_the_engine_args(tmp_path):
    argv = ["bench", "--kv-offloading-size", "0.5", "--kv-offloading-backend", "disk"]
    argv += ["--kv-offloading-path", str(tmp_path)]
    args = pagedllm.cli.app.build_parser().parse_args(argv)
    engine_args = EngineArgs(**pagedllm.cli.app._engine_kwargs(args))
    assert engine_args.kv_offloading_size == 0.5
    assert engine_args.resolved_kv_offloading_backend == "disk"
    assert engine_args.kv_offloading_path == str(tmp_path)


def test_an_unknown_offloading_backend_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        pagedllm.cli.app.build_parser().parse_args(["bench", "--kv-offloading-backend", "lmc"])
    assert "--kv-offloading-backend" in capsys.readouterr().err
