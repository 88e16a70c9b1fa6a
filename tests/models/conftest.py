"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.models import cpu_forward


@pytest.fixture
def engine_pair(monkeypatch):
    """`run(model, prompts, params, *, fused, **engine) -> (llm, outputs, built)`: an engine
    over `model` generating `prompts` with the one-call CPU decoder (`fused`) or with
    `cpu_forward.build` returning None (the layer-by-layer path), one thread and small chunks
    (prompts span several steps, mixed with other sequences' decodes); `built`: what `build`
    returned, in call order."""

    def run(model, prompts, params, *, fused: bool, **engine) -> tuple:
        built = []
        real = cpu_forward.build

        def build(*args, **kwargs):
            result = real(*args, **kwargs) if fused else None
            built.append(result)
            return result

        with monkeypatch.context() as m:
            m.setattr(cpu_forward, "build", build)
            llm = LLM(str(model), max_num_batched_tokens=8, cpu_threads=1, **engine)
            prompts = [{"prompt_token_ids": p} for p in prompts]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        return llm, outputs, built

    return run
