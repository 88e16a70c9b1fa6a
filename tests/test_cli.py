"""The `pagedllm` command on the built-in default model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from pagedllm.cli import main


def test_generate_prints_text_and_a_throughput_summary(capsys):
    assert main(["generate", "Hello", "World", "--max-tokens", "4", "--no-progress",
                 "--device", "cpu", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "[0] 'Hello' -> " in out and "[1] 'World' -> " in out
    assert "2 requests" in out and "generated tok/s" in out


def test_generate_reads_prompts_from_a_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first line\n\nsecond line\n")
    assert main(["generate", "--file", str(prompts), "--max-tokens", "2", "--no-progress",
                 "--device", "cpu", "--max-model-len", "64", "--n", "2", "--temperature", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "[0.0] 'first line'" in out and "[1.1] 'second line'" in out


def test_generate_without_prompts_is_a_usage_error(capsys):
    assert main(["generate", "--device", "cpu"]) == 2
    assert "give prompts" in capsys.readouterr().err


def test_bench_runs_tiny_and_reports_the_step_split(capsys):
    assert main(["bench", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                 "--device", "cpu", "--max-model-len", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["generated_tokens"] == 12
    assert set(result["mean_step_ms"]) == {"schedule", "prepare", "forward", "sample", "update"}
    assert result["output_tokens_per_s"] > 0


def test_bench_compares_with_transformers(capsys):
    assert main(["bench", "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--device", "cpu", "--max-model-len", "64", "--compare-transformers"]) == 0
    out = capsys.readouterr().out
    assert "transformers generate:" in out and "pagedllm / transformers =" in out


def test_installed_entry_point_runs():
    exe = shutil.which("pagedllm") or os.path.join(os.path.dirname(sys.executable), "pagedllm")
    run = subprocess.run([exe, "generate", "Hi", "--max-tokens", "3", "--no-progress",
                          "--device", "cpu", "--max-model-len", "64"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "'Hi' -> " in run.stdout
