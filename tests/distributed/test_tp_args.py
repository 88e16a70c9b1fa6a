"""The tensor-parallel knobs are checked before anything is loaded or spawned."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pagedllm.cli.app import _engine_kwargs, build_parser, loaded_summary
from pagedllm.config import TP_MIN_STARTUP_TIMEOUT_S, EngineArgs
from pagedllm.engine import llm_engine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker import worker

from model_factory import save_tiny_checkpoint


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(worker, "load_model", refuse)  # every rank's Worker loads through it
    monkeypatch.setattr(llm_engine, "create_executor", refuse)


@pytest.mark.parametrize("tp", [0, -1, True, 1.5])
def test_tensor_parallel_size_must_be_a_positive_integer(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=tp)


def test_the_ray_backend_without_ray_installed_is_refused_naming_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ray" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"needs Ray.*pagedllm\[ray\]"):
        EngineArgs(distributed_executor_backend="ray")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(distributed_executor_backend="slurm")


@pytest.mark.parametrize("timeout", [0, -1.0, "5"])
def test_tp_step_timeout_must_be_positive_seconds(timeout):
    with pytest.raises(ValueError, match="tp_step_timeout"):
        EngineArgs(tp_step_timeout=timeout)


def test_the_built_in_tiny_random_model_is_refused_under_tp():
    with pytest.raises(ValueError, match="tiny-random"):
        EngineArgs(tensor_parallel_size=2)


def test_heads_not_divisible_by_tp_are_refused_before_loading(tmp_path, no_model_load):
    folder = save_tiny_checkpoint(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=4"
    ):
        LLMEngine(EngineArgs(model=str(folder), tensor_parallel_size=3, device="cpu"))


def test_kv_heads_neither_divided_by_nor_dividing_tp_are_refused(tmp_path, no_model_load):
    folder = save_tiny_checkpoint(
        tmp_path, "qwen3", num_attention_heads=12, num_key_value_heads=4, head_dim=8
    )
    with pytest.raises(ValueError, match="num_key_value_heads=4 or be a multiple of it"):
        LLMEngine(EngineArgs(model=str(folder), tensor_parallel_size=6, device="cpu"))


def test_tp_runs_on_cpu_only_for_now(tmp_path, no_model_load):
    folder = save_tiny_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="runs on CPU only"):
        LLMEngine(EngineArgs(model=str(folder), tensor_parallel_size=2, device="cuda"))


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_the_cli_takes_tp(command):
    args = build_parser().parse_args([command, "-tp", "2"])
    assert args.tensor_parallel_size == 2


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_the_cli_takes_the_executor_backend(command, backend):
    args = build_parser().parse_args([command, "--distributed-executor-backend", backend])
    assert _engine_kwargs(args)["distributed_executor_backend"] == backend


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_the_cli_takes_the_tp_step_timeout(command):
    args = build_parser().parse_args([command, "--tp-step-timeout", "2.5"])
    assert _engine_kwargs(args)["tp_step_timeout"] == 2.5
    default = build_parser().parse_args([command])
    assert _engine_kwargs(default)["tp_step_timeout"] == EngineArgs().tp_step_timeout


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_the_cli_refuses_a_tp_step_timeout_that_is_not_positive_seconds(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tp-step-timeout", value])
    assert "--tp-step-timeout" in capsys.readouterr().err


def test_the_cli_refuses_an_unknown_executor_backend(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--distributed-executor-backend", "slurm"])
    assert "distributed-executor-backend" in capsys.readouterr().err


def test_ray_is_imported_only_when_the_ray_backend_is_asked_for():
    code = (
        "import sys; import pagedllm.cli.app, pagedllm.engine.llm_engine, pagedllm.executor, "
        "pagedllm.executor.ray_executor, pagedllm.entrypoints.api_server; "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_serve_logs_the_ranks_and_their_launcher(monkeypatch, backend):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # ray or not
    args = EngineArgs(model="/m", tensor_parallel_size=2, distributed_executor_backend=backend)
    engine = SimpleNamespace(
        args=args,
        cache_engine=SimpleNamespace(num_gpu_blocks=8, num_cpu_blocks=2),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=64,
        runner=SimpleNamespace(cpu_threads=1, cpu_isa=("avx2", ["avx2", "fma"])),
        lora=None,
        spec=None,
        tokenizer=None,
    )
    loaded = loaded_summary(engine)[0]
    assert loaded.endswith(
        f"CPU kernels avx2 (avx2 fma), 1 CPU threads per rank, tensor parallel over 2 ranks "
        f"({backend})"
    )


def test_start_up_is_given_at_least_the_floor_however_short_the_step_timeout():
    assert EngineArgs(tp_step_timeout=3).tp_startup_timeout == TP_MIN_STARTUP_TIMEOUT_S
    assert EngineArgs(tp_step_timeout=600).tp_startup_timeout == 600
