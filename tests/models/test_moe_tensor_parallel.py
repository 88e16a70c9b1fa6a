"""A mixture of experts over two tensor-parallel ranks (gloo, the `mp` executor): each rank holds
a slice of every expert (and of the shared expert), or with `enable_expert_parallel` half of the
experts whole; either way the greedy tokens equal one rank's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import pagedllm.cli.app
from pagedllm.config import EngineArgs
from pagedllm.distributed.layers import TPShard
from pagedllm.models import load_model

from engine_util import engine_greedy
from moe_factory import save_tiny_moe_checkpoint

PREFIX = list(range(40, 56))
PROMPTS = [PREFIX + [100 + 7 * i + j for j in range(3 + 2 * i)] for i in range(3)]


def _run(folder, tp: int, expert_parallel: bool = False) -> list[list[int]]:
    args = EngineArgs(
        model=str(folder),
        tensor_parallel_size=tp,
        enable_expert_parallel=expert_parallel,
        device="cpu",
        cpu_threads=1,
        max_model_len=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    return engine_greedy(args, PROMPTS, 12)


def test_two_ranks_holding_a_slice_of_every_expert_generate_the_greedy_tokens_of_one(tmp_path):
    # Qwen2-MoE: routed experts and the gated shared expert, both sharded
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen2_moe", seed=3, num_experts_per_tok=4)
    assert _run(folder, 2) == _run(folder, 1)


def test_an_expert_width_the_ranks_do_not_divide_is_refused(tmp_path):
    folder = save_tiny_moe_checkpoint(tmp_path, "mixtral", intermediate_size=50)
    with pytest.raises(ValueError, match="must divide the experts' width"):
        _run(folder, 4)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_two_ranks_with_and_without_expert_parallelism_generate_the_greedy_tokens_of_one(
    tmp_path, family
):
    folder = save_tiny_moe_checkpoint(tmp_path, family, seed=5, num_experts_per_tok=2)
    one = _run(folder, 1)
    assert _run(folder, 2, expert_parallel=True) == one
    assert _run(folder, 2) == one


def test_expert_parallel_shared_expert_stays_sliced_and_generates_the_greedy_tokens_of_one(
    tmp_path,
):
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen2_moe", seed=3, num_experts_per_tok=4)
    assert _run(folder, 2, expert_parallel=True) == _run(folder, 1)


def test_an_expert_parallel_rank_loads_its_share_of_the_experts_whole(tmp_path):
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen3_moe", num_experts=8)
    model = load_model(folder, dtype="float32", device="cpu", tp=TPShard(1, 2, True))
    experts = model.model.layers[0].mlp.experts
    gate_up, down = experts.stacked()
    tensors = load_file(folder / "model.safetensors")
    prefix = "model.layers.0.mlp.experts."
    # rank 1 of 2 holds experts 4..7, every row and column of each
    assert (experts.first, experts.num_experts, experts.width) == (4, 4, 40)
    for local, expert in enumerate(range(4, 8)):
        want = torch.cat([tensors[f"{prefix}{expert}.{p}_proj.weight"] for p in ("gate", "up")])
        torch.testing.assert_close(gate_up[local], want, rtol=0, atol=0)
        torch.testing.assert_close(down[local], tensors[f"{prefix}{expert}.down_proj.weight"])


def test_expert_parallel_with_experts_the_ranks_do_not_divide_is_refused(tmp_path):
    folder = save_tiny_moe_checkpoint(tmp_path, "qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the number of "):
        _run(folder, 4, expert_parallel=True)


def test_the_enable_expert_parallel_flag_reaches_the_engine_args():
    parser = pagedllm.cli.app.build_parser()
    for argv, want in ((["bench"], False), (["bench", "--enable-expert-parallel"], True)):
        kwargs = pagedllm.cli.app._engine_kwargs(parser.parse_args(argv))
        assert EngineArgs(**kwargs).enable_expert_parallel is want
