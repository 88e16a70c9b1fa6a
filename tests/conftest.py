"""Shared pytest setup for every test folder.

The tests mirror the package: kv/ and scheduler/ (the Rust core through its bindings), engine/,
worker/, sampling/, models/, kernels/, cli/, and packaging/ (the wheel and README.md). Helpers
shared across folders live next to this file (`model_factory`, `scheduler_util`) and are
imported by their plain names: this folder is put on sys.path here.
"""

import importlib.util
import os
import sys

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
