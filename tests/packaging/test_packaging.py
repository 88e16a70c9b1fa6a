"""The wheel: built by maturin, installed into a clean venv, kernels importable under the
package."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "maturin", "build", "--release", "--quiet", "-o", str(out)],
        cwd=ROOT,
        check=True,
    )
    (path,) = glob.glob(str(out / "pagedllm-*.whl"))
    return Path(path)


def test_wheel_is_abi3_for_python_3_11_and_later(wheel):
    assert "-cp311-abi3-" in wheel.name


def test_wheel_ships_kernels_inside_the_package_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    kernel_files = {Path(n).name for n in names if n.startswith("pagedllm/kernels/")}
    on_disk = {"__init__.py", *(p.name for p in (ROOT / "kernels").glob("*.py"))}
    assert on_disk and on_disk <= kernel_files
    assert not [n for n in names if n.startswith("kernels/")]
    assert "pagedllm/py.typed" in names and "pagedllm/_core.pyi" in names


def _dependency_dirs(*names: str) -> list[str]:
    """The sys.path folders that this (the test) environment imports `names` from, if it has
    them."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        folder = str(Path(locations[0] if locations else spec.origin).parent)
        if folder not in dirs:
            dirs.append(folder)
    return dirs


def test_clean_venv_imports_package_and_kernels_from_the_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    # An isolated venv (no system site-packages): the wheel is the only thing installed into it.
    # Its runtime dependencies (torch, numpy, triton where the platform has it) are borrowed from
    # the environment running these tests, i.e. the one README's `pip install ".[test]"` made,
    # never from the base interpreter: a .pth file with plain folder lines appends those folders
    # *after* the venv's own site-packages. So pagedllm and its kernels come from the wheel even if
    # the test environment has pagedllm too, and that folder's own .pth files (the editable hook of
    # a source checkout) are never run.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--force-reinstall",
            str(wheel),
        ],
        check=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    borrowed = _dependency_dirs("torch", "numpy", "triton")
    assert borrowed, "the test environment has no torch/numpy to lend"
    Path(site, "_borrowed_test_deps.pth").write_text("\n".join(borrowed) + "\n")
    kernel_names = sorted(["__init__.py", *(p.name for p in (ROOT / "kernels").glob("*.py"))])
    probe = textwrap.dedent("""
        import importlib.util, os, sys, sysconfig
        import pagedllm
        site = sysconfig.get_paths()["purelib"]
        assert pagedllm.__file__.startswith(site), pagedllm.__file__
        assert "torch" not in sys.modules, "import pagedllm imported torch eagerly"
        manager = pagedllm.KVCacheManager(block_size=16, num_gpu_blocks=8)
        kernels_dir = os.path.join(site, "pagedllm", "kernels")
        for name in sys.argv[1:]:
            path = os.path.join(kernels_dir, name)
            assert os.path.isfile(path) and not os.path.islink(path), path
        import pagedllm.kernels.reference
        mods = ["pagedllm.kernels", "pagedllm.kernels.reference"]
        if importlib.util.find_spec("triton") is not None:
            import pagedllm.kernels.decode_attention, pagedllm.kernels.prefill_attention
            import pagedllm.kernels.store_kv, pagedllm.kernels.block_copy
            mods.append("pagedllm.kernels.decode_attention")
        for mod in mods:
            path = sys.modules[mod].__file__
            assert path.startswith(site) and not os.path.islink(path), path
        assert not os.path.exists(os.path.join(site, "kernels")), "top-level kernels package"
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONNOUSERSITE"] = "1"
    run = subprocess.run(
        [str(python), "-c", probe, *kernel_names],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
