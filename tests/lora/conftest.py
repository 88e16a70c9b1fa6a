"""Fixtures of the LoRA tests: a tiny checkpoint per family with two adapters and the
transformers + peft outputs (built once per session)."""

from __future__ import annotations

import pytest

from lora_util import LoRAWorld


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def world(request, tmp_path_factory) -> LoRAWorld:
    return LoRAWorld(tmp_path_factory.mktemp(f"lora-{request.param}"), request.param)


@pytest.fixture(scope="session")
def llama_world(tmp_path_factory) -> LoRAWorld:
    return LoRAWorld(tmp_path_factory.mktemp("lora-llama-only"), "llama")
