"""The top-level `kernels/` folder (the kernels' source) is not a package of ours:
`pagedllm.kernels` is `python/pagedllm/kernels/` (its `__init__.py` and a symlink per module of
the top-level folder), so nothing started from the repository root that imports `kernels`
(transformers' probe for the Hugging Face kernel hub, a vLLM server) gets our code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
PACKAGE_KERNELS = ROOT / "python" / "pagedllm" / "kernels"


def python_from_the_root(code: str, pythonpath: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_import_kernels_from_the_root_runs_none_of_our_code():
    # The folder is on sys.path from the root, so `import kernels` may find it, but only as a
    # namespace package (no __init__.py); an installed `kernels` (transformers depends on the
    # Hugging Face kernel hub's) wins over it (the next test). Either way no file of ours runs:
    # pagedllm is never imported and no module is loaded from the folder.
    out = python_from_the_root(
        "import kernels, sys; print('pagedllm' in sys.modules, sorted(n for n, m in"
        " list(sys.modules.items()) if (getattr(m, '__file__', None) or '').startswith("
        f"{str(KERNELS) + os.sep!r})))"
    )
    assert out == "False []"


def test_an_installed_kernels_package_wins_over_the_checkout_folder(tmp_path):
    hub = tmp_path / "kernels"
    hub.mkdir()
    (hub / "__init__.py").write_text("")
    out = python_from_the_root("import kernels; print(kernels.__file__)", str(tmp_path))
    assert out == str(hub / "__init__.py")


def test_every_kernel_module_is_linked_into_the_package():
    sources = {p.name for p in KERNELS.glob("*.py")}
    links = {p.name: p for p in PACKAGE_KERNELS.glob("*.py") if p.is_symlink()}
    assert sources and set(links) == sources, "add a symlink per module of kernels/"
    assert all(links[name].resolve() == KERNELS / name for name in sources)
    assert (PACKAGE_KERNELS / "__init__.py").is_file() and "__init__.py" not in sources
