"""Shared fixture of the structured-output tests: one engine on the built-in random model."""

from __future__ import annotations

import pytest

from pagedllm import LLM


@pytest.fixture(scope="package")
def llm():
    return LLM(device="cpu", block_size=8, max_model_len=256, num_gpu_blocks=512, seed=0)
