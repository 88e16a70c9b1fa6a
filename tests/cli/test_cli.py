"""The `pagedllm` command on the built-in default model."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import pagedllm.cli.app
import pagedllm.cli.bench
from pagedllm import EngineArgs
from pagedllm.cli import DEBUG_ENV, main


def test_generate_prints_text_and_a_throughput_summary(capsys):
    assert (
        main(
            [
                "generate",
                "Hello",
                "World",
                "--max-tokens",
                "4",
                "--no-progress",
                "--device",
                "cpu",
                "--max-model-len",
                "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[0] 'Hello' -> " in out and "[1] 'World' -> " in out
    assert "2 requests" in out and "generated tok/s" in out


def test_engine_flag_defaults_are_the_engine_args():
    args = pagedllm.cli.app.build_parser().parse_args(["generate", "x"])
    defaults = EngineArgs()
    for name in (
        "model",
        "tokenizer",
        "device",
        "dtype",
        "seed",
        "block_size",
        "num_gpu_blocks",
        "gpu_memory_utilization",
        "swap_space",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "scheduling",
        "policy",
        "preemption_mode",
    ):
        assert getattr(args, name) == getattr(defaults, name), name
    assert args.no_prefix_caching != defaults.enable_prefix_caching


def test_generate_reads_prompts_from_a_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first line\n\nsecond line\n")
    assert (
        main(
            [
                "generate",
                "--file",
                str(prompts),
                "--max-tokens",
                "2",
                "--no-progress",
                "--device",
                "cpu",
                "--max-model-len",
                "64",
                "--n",
                "2",
                "--temperature",
                "0.7",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[0.0] 'first line'" in out and "[1.1] 'second line'" in out


def test_generate_without_prompts_is_a_usage_error(capsys):
    assert main(["generate", "--device", "cpu"]) == 2
    assert "give prompts" in capsys.readouterr().err


def test_bench_runs_tiny_and_reports_the_step_split(capsys):
    assert (
        main(
            [
                "bench",
                "--num-prompts",
                "3",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--device",
                "cpu",
                "--max-model-len",
                "64",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["generated_tokens"] == 12
    assert result["ignored_prompts"] == 0 and result["prompt_tokens"] == 24
    assert set(result["mean_step_ms"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert result["output_tokens_per_s"] > 0


def test_bench_compares_with_transformers(capsys):
    assert (
        main(
            [
                "bench",
                "--num-prompts",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "3",
                "--device",
                "cpu",
                "--max-model-len",
                "64",
                "--compare-transformers",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "transformers generate:" in out and "pagedllm / transformers =" in out


def test_installed_entry_point_runs():
    exe = shutil.which("pagedllm") or os.path.join(os.path.dirname(sys.executable), "pagedllm")
    run = subprocess.run(
        [
            exe,
            "generate",
            "Hi",
            "--max-tokens",
            "3",
            "--no-progress",
            "--device",
            "cpu",
            "--max-model-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "'Hi' -> " in run.stdout


# ---- user errors: one line on stderr, non-zero exit, no traceback unless asked for --------------


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m pagedllm.cli ARGS` in a fresh process, debug switch off unless `env` sets it."""
    base = {k: v for k, v in os.environ.items() if k != DEBUG_ENV}
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **(env or {})},
    )


def assert_one_line_error(run: subprocess.CompletedProcess, *words: str) -> str:
    assert run.returncode != 0, run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("pagedllm") and "error: " in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from model_factory import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def _copy_checkpoint(checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    return folder


def test_missing_model_folder_is_a_one_line_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--model", missing), missing, "does not exist"
    )


def test_model_folder_without_a_checkpoint_is_a_one_line_error(tmp_path):
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--model", str(tmp_path)), "config.json"
    )


def test_malformed_model_config_is_a_one_line_error(checkpoint, tmp_path):
    folder = _copy_checkpoint(checkpoint, tmp_path)
    (folder / "config.json").write_text('{"model_type": "llama",')
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--model", str(folder)),
        "config.json",
        "malformed JSON",
    )


def test_truncated_safetensors_is_a_one_line_error(checkpoint, tmp_path):
    folder = _copy_checkpoint(checkpoint, tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--model", str(folder)), "model.safetensors"
    )


def test_max_tokens_zero_is_a_one_line_error():
    line = assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--max-tokens", "0"), "--max-tokens", ">= 1"
    )
    assert "0" in line


def test_temperature_nan_is_a_one_line_error():
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--temperature", "nan"), "--temperature", "nan"
    )


def test_non_numeric_flag_value_is_a_one_line_error():
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--top-k", "many"), "--top-k", "'many'"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_device_without_a_gpu_is_a_one_line_error():
    assert_one_line_error(run_cli("generate", "Hi", "--device", "cuda"), "--device cuda", "GPU")


def test_unknown_device_is_a_one_line_error():
    assert_one_line_error(run_cli("generate", "Hi", "--device", "tpu9"), "--device", "tpu9")


def test_missing_prompt_file_is_a_one_line_error(tmp_path):
    missing = str(tmp_path / "prompts.txt")
    assert_one_line_error(run_cli("generate", "--file", missing, "--device", "cpu"), missing)


def test_bench_negative_num_prompts_is_a_one_line_error():
    assert_one_line_error(
        run_cli("bench", "--num-prompts", "-3", "--device", "cpu"), "--num-prompts", ">= 1", "-3"
    )


@pytest.mark.parametrize("flag", ["--input-len", "--output-len"])
def test_bench_zero_length_is_a_one_line_error(flag):
    assert_one_line_error(run_cli("bench", flag, "0", "--device", "cpu"), flag, ">= 1")


def test_bench_refuses_prompts_longer_than_max_model_len():
    run = run_cli(
        "bench",
        "--num-prompts",
        "2",
        "--input-len",
        "300",
        "--output-len",
        "4",
        "--max-model-len",
        "256",
        "--device",
        "cpu",
    )
    assert_one_line_error(run, "300", "max_model_len=256", "ignored")
    assert "tok/s" not in run.stdout


def test_bench_refuses_outputs_that_would_be_cut_short_by_max_model_len():
    run = run_cli(
        "bench",
        "--num-prompts",
        "2",
        "--input-len",
        "250",
        "--output-len",
        "10",
        "--max-model-len",
        "256",
        "--device",
        "cpu",
    )
    assert_one_line_error(run, "260", "max_model_len=256")
    assert "tok/s" not in run.stdout


def test_bench_checks_lengths_against_the_model_max_len_when_not_given():
    # the built-in model's max_model_len is its max_position_embeddings (2048)
    run = run_cli(
        "bench", "--num-prompts", "1", "--input-len", "2049", "--output-len", "1", "--device", "cpu"
    )
    assert_one_line_error(run, "2049", "max_model_len=2048")


def test_bench_never_counts_ignored_prompts_as_processed(monkeypatch, capsys):
    # get past the up-front refusal: the engine itself ignores the over-long prompts
    monkeypatch.setattr(pagedllm.cli.bench, "check_lengths", lambda *args, **kwargs: None)
    code = main(
        [
            "bench",
            "--num-prompts",
            "2",
            "--input-len",
            "300",
            "--output-len",
            "4",
            "--max-model-len",
            "256",
            "--device",
            "cpu",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert code != 0
    assert result["ignored_prompts"] == 2 and result["completed_prompts"] == 0
    assert "max_model_len=256" in result["ignored_reason"]
    assert result["generated_tokens"] == 0 and result["prompt_tokens"] == 0
    assert result["output_tokens_per_s"] == 0 and result["total_tokens_per_s"] == 0
    (line,) = captured.err.splitlines()
    assert line.startswith("pagedllm: error: 2 of 2 prompts were ignored")


def test_bench_summary_warns_about_ignored_prompts(monkeypatch, capsys):
    monkeypatch.setattr(pagedllm.cli.bench, "check_lengths", lambda *args, **kwargs: None)
    assert (
        main(
            [
                "bench",
                "--num-prompts",
                "2",
                "--input-len",
                "300",
                "--output-len",
                "4",
                "--max-model-len",
                "256",
                "--device",
                "cpu",
            ]
        )
        != 0
    )
    out = capsys.readouterr().out
    assert "WARNING: 2 of 2 prompts ignored" in out and " 0.0 total tok/s" in out


def test_debug_flag_shows_the_traceback():
    run = run_cli(
        "generate",
        "Hi",
        "--device",
        "cpu",
        "--max-model-len",
        "64",
        "--model",
        "/no/such/model",
        "--debug",
    )
    assert run.returncode != 0
    assert "Traceback" in run.stderr and "/no/such/model" in run.stderr.splitlines()[-1]


def test_debug_flag_before_the_subcommand_shows_the_traceback():
    run = run_cli("--debug", "generate", "Hi", "--device", "cpu", "--model", "/no/such/model")
    assert run.returncode != 0 and "Traceback" in run.stderr


def test_debug_environment_switch_shows_the_traceback():
    run = run_cli(
        "generate", "Hi", "--device", "cpu", "--model", "/no/such/model", env={DEBUG_ENV: "1"}
    )
    assert run.returncode != 0 and "Traceback" in run.stderr


def test_help_documents_the_debug_flag_and_environment_switch():
    for args in ([], ["generate"], ["bench"]):
        run = run_cli(*args, "--help")
        assert run.returncode == 0
        text = " ".join(run.stdout.split())
        assert "--debug" in text and f"{DEBUG_ENV}=1" in text, run.stdout


def test_keyboard_interrupt_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(pagedllm.cli.app, "_generate", interrupted)
    assert main(["generate", "Hi"]) == 130
    assert capsys.readouterr().err.splitlines() == ["pagedllm: interrupted"]


def test_unexpected_error_is_one_line_that_points_to_debug(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("kernel exploded\non two lines")

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(pagedllm.cli.app, "_generate", broken)
    assert main(["generate", "Hi"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "RuntimeError: kernel exploded on two lines" in line and "--debug" in line


def test_bench_refuses_prompts_over_the_prefill_first_token_budget():
    run = run_cli(
        "bench",
        "--num-prompts",
        "2",
        "--input-len",
        "32",
        "--output-len",
        "4",
        "--max-model-len",
        "64",
        "--scheduling",
        "prefill_first",
        "--max-num-batched-tokens",
        "16",
        "--device",
        "cpu",
    )
    assert_one_line_error(run, "max_num_batched_tokens=16", "--max-num-batched-tokens")


# ---- the first hour: flags, help and messages a new user meets -------------------------------


def _parsers(parser: argparse.ArgumentParser):
    """`parser` and every (nested) subcommand's parser."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_bench_takes_no_progress_like_the_other_commands():
    parser = pagedllm.cli.app.build_parser()
    for command in (["generate", "x"], ["bench"], ["bench", "serve"]):
        assert parser.parse_args([*command, "--no-progress"]).no_progress is True, command


@pytest.mark.parametrize("command", [["generate"], ["bench"], ["bench", "serve"], ["serve"]])
def test_unknown_flag_names_the_subcommands_help(command):
    prog = " ".join(["pagedllm", *command])
    assert_one_line_error(run_cli(*command, "--no-such-flag"), "--no-such-flag", f"{prog} --help")


def test_missing_draft_model_folder_is_a_one_line_error_naming_the_draft_model(tmp_path):
    missing = str(tmp_path / "no-such-draft")
    spec = json.dumps({"method": "draft_model", "model": missing, "num_speculative_tokens": 2})
    assert_one_line_error(
        run_cli("generate", "Hi", "--device", "cpu", "--speculative-config", spec),
        "draft model",
        missing,
        "does not exist",
    )


def test_every_option_has_help_text():
    for parser in _parsers(pagedllm.cli.app.build_parser()):
        for action in parser._actions:
            assert action.help, f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"


def test_help_shows_every_options_default():
    for parser in _parsers(pagedllm.cli.app.build_parser()):
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if action.default is None or action.default is False or not action.option_strings:
                continue  # no value to show: its help says what happens (checked above)
            if action.default is argparse.SUPPRESS or "default" in action.help:
                continue
            assert f"(default: {action.default})" in text, f"{parser.prog} {action.dest}"
    generate = " ".join(run_cli("generate", "--help").stdout.split())
    assert f"tokens per KV block (default: {EngineArgs().block_size})" in generate


def test_serve_logs_what_it_loaded(monkeypatch, capsys):
    import pagedllm.entrypoints.api_server as api_server

    monkeypatch.setattr(api_server, "run_server", lambda app, *args, **kwargs: 0)
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    argv = ["serve", "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks", "32"]
    assert main([*argv, "--cpu-threads", "1", "--speculative-config", spec]) == 0
    err = capsys.readouterr().err
    for part in (
        "loaded pagedllm/tiny-random on cpu in float32",
        "max_model_len 64",
        "KV cache 32 blocks on the device",
        "16 tokens per block",
        "1 CPU threads",
        "LoRA off",
        "speculative decoding ngram (k=3)",
        "structured output on",
    ):
        assert part in err, err
