"""The fused CPU forward (`_core.CpuDecoder`) with a quantized cache's key transform
(`attention/key_transform.py`): the layer-by-layer path's numbers exactly, and a transform of
the wrong size refused naming it."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams, _core
from pagedllm.models import cpu_forward

from model_factory import save_tiny_checkpoint

PROMPTS = [[5, 9, 33, 71, 2, 8, 100, 41, 17, 3, 64, 12, 90, 7], [11, 12, 13]]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def _run(monkeypatch, folder, *, fused: bool, kv_cache_dtype: str):
    built = []
    real = cpu_forward.build

    def build(*args, **kwargs):
        result = real(*args, **kwargs) if fused else None
        built.append(result)
        return result

    with monkeypatch.context() as m:
        m.setattr(cpu_forward, "build", build)
        llm = LLM(
            str(folder),
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=8,  # prompts over several steps, mixed with decodes
            cpu_threads=1,
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert llm.llm_engine.cache_engine.key_calibration is not None
    values = []
    for o in outputs:
        for position in [*o.prompt_logprobs, *o.outputs[0].logprobs]:
            if position is not None:
                values.append(sorted((t, lp.logprob) for t, lp in position.items()))
    return [o.outputs[0].token_ids for o in outputs], values, built


@pytest.mark.parametrize(("family", "kv_cache_dtype"), [("llama", "int8"), ("qwen3", "fp8_e4m3")])
def test_fused_forward_with_a_key_transform_gives_the_layer_by_layer_numbers(
    monkeypatch, tmp_path, family, kv_cache_dtype
):
    # qwen3: q/k norms before the rotation (the transform on their own buffers)
    folder = save_tiny_checkpoint(tmp_path / "m", family, hidden_size=64, intermediate_size=128)
    fused = _run(monkeypatch, folder, fused=True, kv_cache_dtype=kv_cache_dtype)
    assert fused[2][0] is not None
    plain = _run(monkeypatch, folder, fused=False, kv_cache_dtype=kv_cache_dtype)
    assert fused[:2] == plain[:2]


def test_a_key_transform_of_the_wrong_size_is_a_value_error_naming_it():
    hidden, heads, kv_heads, d = 64, 4, 2, 16
    norm = np.ones(hidden, dtype=np.float32)
    panels = lambda n, k: ("panels", np.zeros((-(-n // 16), k, 16), np.float32), n, None)  # noqa: E731
    layer = (
        norm,
        panels((heads + 2 * kv_heads) * d, hidden),
        None,
        None,
        panels(hidden, heads * d),
        norm,
        panels(256, hidden),
        panels(hidden, 128),
    )
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    transform = (ones(heads * d), ones(kv_heads * d), ones(kv_heads * d - 1))
    decoder = _core.CpuDecoder(
        [layer], norm, heads, kv_heads, d, 1e-6, 0.25, key_transforms=[transform]
    )
    x = np.zeros((1, hidden), dtype=np.float32)
    cos = np.ones((1, d // 2), dtype=np.float32)
    kv = np.zeros((2, 1, 1, 4, kv_heads, d), dtype=np.float32)
    with pytest.raises(ValueError, match="key transform"):
        decoder.forward(
            x,
            cos,
            cos * 0,
            np.zeros(1, np.int64),
            np.array([0, 1], np.int32),
            np.array([1], np.int32),
            np.zeros((1, 1), np.int32),
            kv,
            1,
        )
