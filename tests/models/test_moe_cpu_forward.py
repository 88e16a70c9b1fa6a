"""Mixtures of experts in the one-call CPU decoder (`models/cpu_forward.py`, the sparse layer of
`rust/src/cpu/forward/moe_layer.rs`): the same greedy tokens, logprobs (to the routing softmax's
last bits) and per-expert token counts as the layer-by-layer path, on float32, bfloat16 (whose
router logits tie often: the fused routing picks among equal experts as torch.topk does) and
Q8_0 experts, with a shared expert and with dense layers among sparse ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.models.moe import expert_token_counts

from moe_factory import save_tiny_moe_checkpoint, save_tiny_moe_gguf

PROMPTS = [
    [5, 9, 33, 71, 2, 8, 100, 41, 17, 3, 64, 12, 90, 7],
    [11, 12, 13],
    [200, 150, 100, 50, 25, 12, 6, 3, 1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 121, 144],
]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
CASES = {
    "qwen3_moe_dense_layer": (
        "qwen3_moe",
        dict(num_experts=16, num_experts_per_tok=8, num_hidden_layers=3, mlp_only_layers=[1]),
    ),
    "qwen2_moe_shared_expert": ("qwen2_moe", dict(num_experts=12, num_experts_per_tok=4)),
    "mixtral": ("mixtral", dict(num_experts=8, num_experts_per_tok=2)),
}


@pytest.fixture
def generate(engine_pair):
    def run(model, *, fused: bool, **engine) -> tuple:
        """(tokens, logprobs, expert counts, what `build` returned) for PROMPTS."""
        llm, outs, built = engine_pair(model, PROMPTS, PARAMS, fused=fused, **engine)
        tokens = [o.outputs[0].token_ids for o in outs]
        logprobs = [
            sorted((t, lp.logprob) for t, lp in position.items())
            for o in outs
            for position in o.outputs[0].logprobs
        ]
        return tokens, logprobs, expert_token_counts(llm.llm_engine.model), built

    return run


def _assert_same(fused: tuple, plain: tuple) -> None:
    tokens, logprobs, counts, built = fused
    assert built and built[0] is not None  # the one-call path did run
    assert tokens == plain[0]
    assert counts == plain[2] and sum(map(sum, counts.values())) > 0
    for got, want in zip(logprobs, plain[1], strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_a_sparse_model_in_one_call_gives_the_layer_by_layer_tokens_and_counts(
    generate, tmp_path, case
):
    family, shape = CASES[case]
    save_tiny_moe_checkpoint(tmp_path, family, seed=3, **shape)
    fused = generate(str(tmp_path), fused=True, dtype="float32")
    plain = generate(str(tmp_path), fused=False, dtype="float32")
    _assert_same(fused, plain)


def test_quantized_experts_in_one_call_give_the_layer_by_layer_tokens_and_counts(
    generate, tmp_path
):
    path = save_tiny_moe_gguf(
        tmp_path,
        "qwen2_moe",
        seed=3,
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=4,
        shared_expert_intermediate_size=128,
    )
    engine = dict(dtype="float32", skip_tokenizer_init=True)  # the file holds no tokenizer
    fused = generate(str(path), fused=True, **engine)
    plain = generate(str(path), fused=False, **engine)
    _assert_same(fused, plain)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bfloat16_sparse_model_in_one_call_gives_the_layer_by_layer_tokens_and_counts(
    generate, tmp_path, case
):
    family, shape = CASES[case]
    save_tiny_moe_checkpoint(tmp_path, family, seed=3, **shape)
    fused = generate(str(tmp_path), fused=True, dtype="bfloat16")
    plain = generate(str(tmp_path), fused=False, dtype="bfloat16")
    _assert_same(fused, plain)


def _moe_layer(top_k: int, hidden: int = 64, width: int = 32, experts: int = 4) -> tuple:
    norm = np.ones(hidden, np.float32)

    def panels(n, k):
        return ("panels", np.zeros((-(-n // 16), k, 16), np.float32), n, None)

    stacked = (
        "panels",
        np.zeros((experts, 2 * width // 16, hidden, 16), np.float32),
        np.zeros((experts, hidden // 16, width, 16), np.float32),
    )
    counts = np.zeros(experts, np.int64)
    moe = ("moe", panels(experts, hidden), stacked, top_k, (True, False), None, counts)
    return (norm, panels(3 * hidden, hidden), None, None, panels(hidden, hidden), norm, moe, None)


def _forward(decoder, hidden: int = 64) -> None:
    tables = np.zeros((1, 32), np.float32)
    decoder.forward(
        np.zeros((1, hidden), np.float32),
        tables,
        tables,
        np.zeros(1, np.int64),
        np.array([0, 1], np.int32),
        np.array([1], np.int32),
        np.zeros((1, 1), np.int32),
        np.zeros((2, 1, 4, 16, 1, 64), np.float32),
        1,
    )


def test_a_sparse_layer_choosing_more_experts_than_it_has_is_a_value_error_naming_top_k():
    from pagedllm import _core

    norm = np.ones(64, np.float32)
    decoder = _core.CpuDecoder([_moe_layer(top_k=5)], norm, 1, 1, 64, 1e-6, 0.125)
    with pytest.raises(ValueError, match=r"layer 0: top_k 5 must be in 1..=4"):
        _forward(decoder)


def test_a_sparse_layer_counts_each_tokens_chosen_experts():
    from pagedllm import _core

    layer = _moe_layer(top_k=2)
    decoder = _core.CpuDecoder([layer], np.ones(64, np.float32), 1, 1, 64, 1e-6, 0.125)
    _forward(decoder)
    # zero router logits: equal probabilities, the two torch.topk picks among them chosen
    picked = torch.topk(torch.full((4,), 0.25), 2).indices
    assert layer[6][-1].tolist() == torch.bincount(picked, minlength=4).tolist()
