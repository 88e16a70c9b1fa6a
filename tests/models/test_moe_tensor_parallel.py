"""A mixture of experts over two tensor-parallel ranks (gloo, the `mp` executor): each rank holds
a slice of every expert (and of the shared expert), and the greedy tokens equal one rank's."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

from moe_factory import save_tiny_moe_checkpoint

PREFIX = list(range(40, 56))
PROMPTS = [PREFIX + [100 + 7 * i + j for j in range(3 + 2 * i)] for i in range(3)]


def _run(folder, tp: int) -> list[list[int]]:
    engine = LLMEngine(
        EngineArgs(
            model=str(folder),
            tensor_parallel_size=tp,
            device="cpu",
            cpu_threads=1,
            max_model_len=64,
            max_num_batched_tokens=16,
            enable_prefix_caching=True,
        )
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, ids in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        return [tokens[str(i)] for i in range(len(PROMPTS))]
    finally:
        engine.shutdown()


def test_two_ranks_holding_a_slice_of_every_expert_generate_the_greedy_tokens_of_one(tmp_path):
    # Qwen2-MoE: routed experts and the gated shared expert, both sharded
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen2_moe", seed=3, num_experts_per_tok=4)
    assert _run(folder, 2) == _run(folder, 1)


def test_an_expert_width_the_ranks_do_not_divide_is_refused(tmp_path):
    folder = save_tiny_moe_checkpoint(tmp_path, "mixtral", intermediate_size=50)
    with pytest.raises(ValueError, match="must divide the experts' width"):
        _run(folder, 4)
