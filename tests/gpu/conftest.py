"""The GPU tests: the engine and its CUDA paths on a real device (benches/gpu/run.sh runs them
there). Without CUDA every test in this folder is collected and skipped with that reason, never
silently absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "needs a CUDA GPU (benches/gpu/run.sh runs these on a device)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)
