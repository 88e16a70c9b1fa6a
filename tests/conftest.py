"""Shared pytest setup."""
import importlib.util
import os
import sys

import torch

# Triton kernels run under the CPU interpreter when no CUDA GPU is present. This must be set before
# anything imports triton, hence at conftest import time (torch.cuda does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Let the tests run from a source checkout that has not been pip-installed.
if importlib.util.find_spec("pagedllm") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
