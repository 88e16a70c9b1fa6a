"""The wheel: built by maturin, installed into a clean venv, kernels importable under the package."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "maturin", "build", "--release", "--quiet", "-o", str(out)],
                   cwd=ROOT, check=True)
    (path,) = glob.glob(str(out / "pagedllm-*.whl"))
    return Path(path)


def test_wheel_is_abi3_for_python_3_11_and_later(wheel):
    assert "-cp311-abi3-" in wheel.name


def test_wheel_ships_kernels_inside_the_package_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    kernel_files = {Path(n).name for n in names if n.startswith("pagedllm/kernels/")}
    on_disk = {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert on_disk and on_disk <= kernel_files
    assert not [n for n in names if n.startswith("kernels/")]
    assert "pagedllm/py.typed" in names and "pagedllm/_core.pyi" in names


def test_clean_venv_imports_package_and_kernels_from_the_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    # --system-site-packages only to borrow torch/triton; the venv's own site-packages (where the
    # wheel goes) comes first on sys.path, so pagedllm is imported from the wheel.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--force-reinstall", str(wheel)], check=True)
    probe = textwrap.dedent("""
        import importlib.util, os, sys, sysconfig
        import pagedllm
        site = sysconfig.get_paths()["purelib"]
        assert pagedllm.__file__.startswith(site), pagedllm.__file__
        assert "torch" not in sys.modules, "import pagedllm imported torch eagerly"
        manager = pagedllm.KVCacheManager(block_size=16, num_gpu_blocks=8)
        import pagedllm.kernels.reference
        import pagedllm.kernels.decode_attention, pagedllm.kernels.prefill_attention
        import pagedllm.kernels.store_kv, pagedllm.kernels.block_copy
        for mod in ("pagedllm.kernels", "pagedllm.kernels.decode_attention"):
            path = sys.modules[mod].__file__
            assert path.startswith(site) and not os.path.islink(path), path
        assert not os.path.exists(os.path.join(site, "kernels")), "top-level kernels package"
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
