"""Shared pytest setup for every test folder.

The tests mirror the package: kv/ and scheduler/ (the Rust core through its bindings), engine/,
worker/, attention/, sampling/, models/, kernels/, cli/, and packaging/ (the wheel, README.md and
the package's layering). Helpers
shared across folders live next to this file (`model_factory`, `scheduler_util`) and are
imported by their plain names: this folder is put on sys.path here.
"""

import importlib.util
import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# Triton kernels run under the CPU interpreter when no CUDA GPU is present. This must be set before
# anything imports triton, hence at conftest import time (torch.cuda does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Let the tests run from a source checkout that has not been pip-installed.
if importlib.util.find_spec("pagedllm") is None:
    sys.path.insert(0, os.path.join(ROOT, "python"))


@pytest.fixture
def fail_sampling_of_seed(monkeypatch):
    """`fail_sampling_of_seed(seed)`: from then on, building the sampling metadata of any batch
    that holds a request with that seed raises IndexError (a fault injected into one request)."""
    from pagedllm.sampling import SamplingMetadata

    build = SamplingMetadata.build

    def inject(seed: int) -> None:
        def failing_build(params, *args, **kwargs):
            if any(p.seed == seed for p in params):
                raise IndexError("selected index out of range (injected)")
            return build(params, *args, **kwargs)

        monkeypatch.setattr(SamplingMetadata, "build", failing_build)

    return inject
