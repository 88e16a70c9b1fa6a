"""benches/gpu/gpu_check.py's dry run (the device script's stages on the CPU, Triton interpreter,
tiny sizes): every stage runs to its figures, the GPU tests are collected and skipped, and a stage
past its budget is stopped without stopping the stages after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pagedllm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "gpu" / "gpu_check.py"


def dry_run(tmp_path: Path, *args: str) -> tuple[int, dict, str, Path]:
    env = dict(os.environ)
    # the stages import the pagedllm this test imported (installed, or the source tree)
    package_root = str(Path(pagedllm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path),
            *args,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    summary = json.loads((out / "gpu_check.json").read_text())
    return proc.returncode, summary, proc.stdout + proc.stderr, out


@pytest.fixture(scope="module")
def full_dry_run(tmp_path_factory):
    return dry_run(tmp_path_factory.mktemp("gpu_check"))


def test_dry_run_runs_every_stage_to_its_figures(full_dry_run):
    code, summary, output, _ = full_dry_run
    assert code == 0, output
    stages = summary["stages"]
    assert list(stages) == ["env", "tests", "throughput", "hf_generate", "decode_step", "attention"]
    assert all(s["status"] == "ok" for s in stages.values()), stages
    assert stages["env"]["copy_bw_GBps"] > 0
    assert stages["throughput"]["pagedllm_output_tok_s"] > 0
    assert stages["hf_generate"]["hf_output_tok_s"] > 0
    assert stages["decode_step"]["floor_ms"] > 0 and stages["decode_step"]["eager_ms"] > 0
    assert stages["attention"]["kernel_over_copy_bw"] > 0
    assert stages["attention"]["rel_error"] < 1e-4
    # the summary table is the output's last lines (the device call's reply shows the tail)
    assert output.rstrip().splitlines()[-1].startswith("total ")


def test_dry_run_writes_a_results_table_with_every_stage(full_dry_run):
    _, summary, _, out = full_dry_run
    table = (out / "gpu_check.md").read_text()
    assert table.startswith("Device: cpu;") and "dry run" in table
    for name in summary["stages"]:
        assert f"| {name} | ok |" in table


def test_dry_run_collects_the_gpu_tests_and_skips_them(full_dry_run):
    _, summary, _, _ = full_dry_run
    tests = summary["stages"]["tests"]
    assert tests["skipped"] > 0 and tests["passed"] > 0
    assert tests["failures"] == 0 and tests["errors"] == 0


def test_a_stage_past_its_budget_is_stopped_and_the_next_still_runs(tmp_path):
    code, summary, _, _ = dry_run(tmp_path, "--stages", "env,attention", "--budget-scale", "0.002")
    assert code == 1
    assert [s["status"] for s in summary["stages"].values()] == ["timeout", "timeout"]
    assert all(s["seconds"] < 5 for s in summary["stages"].values())


@pytest.fixture
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check

        return gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_device_budgets_fit_one_eight_minute_run(gpu_check):
    device_total = sum(device for device, _ in gpu_check.BUDGETS.values())
    assert device_total <= gpu_check.DEVICE_RUN_LIMIT_S
    assert set(gpu_check.BUDGETS) == set(gpu_check.STAGES) == set(gpu_check.HEADLINE)


def test_a_failed_graph_capture_is_recorded_and_the_engine_built_eagerly(gpu_check, tmp_path):
    built = []

    def build(eager: bool):
        built.append(eager)
        if not eager:
            raise RuntimeError("capture failed")
        return "engine"

    rec = gpu_check.Record(tmp_path / "stage.json")
    assert gpu_check.start_engine(rec, build) == "engine"
    assert built == [False, True]
    assert (
        "capture failed" in json.loads((tmp_path / "stage.json").read_text())["graph_start_error"]
    )


def test_tests_override_runs_only_the_named_tests(tmp_path):
    test_id = "tests/kernels/test_kernels.py::test_choose_num_splits_is_static_and_bounded"
    code, summary, _, _ = dry_run(tmp_path, "--stages", "tests", "--tests", test_id)
    assert code == 0
    tests = summary["stages"]["tests"]
    assert tests["tests"] == tests["passed"] == 1 and tests["skipped"] == 0


def test_unknown_stage_is_refused_by_name(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--stages", "env,nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "nope" in proc.stderr
