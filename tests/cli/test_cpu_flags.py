"""`--cpu-threads` and `--cpu-kv-cache-space`: parsed into EngineArgs, bad values refused with
one line naming the flag."""

from __future__ import annotations

import pytest
import torch

import pagedllm.cli.app
from pagedllm import LLM, EngineArgs
from pagedllm.cli import main


def test_cpu_flags_default_to_the_engine_args():
    args = pagedllm.cli.app.build_parser().parse_args(["generate", "x"])
    kwargs = pagedllm.cli.app._engine_kwargs(args)
    assert kwargs["cpu_threads"] is None and EngineArgs().cpu_threads is None
    assert kwargs["cpu_kv_cache_space"] == EngineArgs().cpu_kv_cache_space


def test_cpu_flags_reach_the_engine_args():
    args = pagedllm.cli.app.build_parser().parse_args(
        ["bench", "--cpu-threads", "3", "--cpu-kv-cache-space", "0.25"]
    )
    engine_args = EngineArgs(**pagedllm.cli.app._engine_kwargs(args))
    assert engine_args.cpu_threads == 3 and engine_args.cpu_kv_cache_space == 0.25


@pytest.mark.parametrize(
    "flag,value,words",
    [
        ("--cpu-threads", "0", ">= 1"),
        ("--cpu-threads", "two", "'two'"),
        ("--cpu-kv-cache-space", "0", "(0, inf)"),
        ("--cpu-kv-cache-space", "nan", "'nan'"),
    ],
)
def test_bad_cpu_flag_values_are_usage_errors(capsys, flag, value, words):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "Hi", "--device", "cpu", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err


@pytest.mark.parametrize("space", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_engine_args_refuse_a_bad_cpu_kv_cache_space(space):
    with pytest.raises(ValueError, match="cpu_kv_cache_space must be a number of GiB > 0"):
        EngineArgs(cpu_kv_cache_space=space)


def test_engine_args_refuse_a_bad_cpu_thread_count():
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineArgs(cpu_threads=0)


def test_cpu_kv_cache_space_sizes_the_cache_in_gib():
    threads = torch.get_num_threads()
    try:
        llm = LLM(device="cpu", cpu_kv_cache_space=1 / 1024, max_model_len=64, cpu_threads=1)
        engine = llm.engine
        block_bytes = engine.cache_engine.kv_cache[:, :, 0].numel() * 4
        assert engine.cache_engine.num_gpu_blocks == (1 << 20) // block_bytes
        assert torch.get_num_threads() == 1 and engine.runner.cpu_threads == 1
    finally:
        torch.set_num_threads(threads)


def test_cpu_kv_cache_space_beyond_the_machines_memory_is_refused(monkeypatch):
    import pagedllm.engine.kv_sizing as kv_sizing

    monkeypatch.setattr(kv_sizing, "available_host_memory", lambda: 1 << 20)
    with pytest.raises(ValueError, match="only 0.00 GiB of memory is available"):
        LLM(device="cpu", cpu_kv_cache_space=0.5, max_model_len=64)
