"""The CUDA path of tensor parallelism, checked without a GPU: ranks on CUDA join over NCCL bound to
their own device, and the sharded layers hand the collectives tensors of the right shapes that
never leave the rank's device (NCCL takes device tensors only; `meta` stands in for CUDA here)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import parallel_state
from pagedllm.distributed.layers import (
    ParallelLMHead,
    RowParallelLinear,
    TPShard,
    VocabParallelEmbedding,
)

TOKENS, HIDDEN, VOCAB = 5, 64, 300  # vocabulary padded to 320: 160 rows per rank


class FakeGroup:
    """torch.distributed as rank `rank` of `size` sees it: each collective is recorded as
    (name, shape, device); a gather hands back rank r's part filled with r."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.calls: list[tuple[str, tuple[int, ...], str]] = []

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.size

    def all_reduce(self, x: torch.Tensor) -> None:
        self.calls.append(("all_reduce", tuple(x.shape), x.device.type))

    def gather(self, x: torch.Tensor, parts, dst: int) -> None:
        self.calls.append(("gather", tuple(x.shape), x.device.type))
        assert (parts is not None) == (self.rank == dst)
        for r, part in enumerate(parts or ()):
            assert part.device == x.device and part.shape == x.shape
            if part.device.type != "meta":
                part.fill_(r)


@pytest.fixture
def group(monkeypatch):
    fake = FakeGroup(0, 2)
    monkeypatch.setattr(parallel_state, "dist", fake)
    return fake


@pytest.mark.parametrize(
    ("device", "backend"), [(torch.device("cuda", 1), "nccl"), (torch.device("cpu"), "gloo")]
)
def test_ranks_join_over_nccl_on_cuda_and_gloo_on_cpu(monkeypatch, device, backend):
    joined, current = {}, []
    monkeypatch.setattr(
        parallel_state.dist,
        "init_process_group",
        lambda name, **kwargs: joined.update(backend=name, **kwargs),
    )
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(parallel_state, "_wait_for_every_rank", lambda store, size: None)
    # no group really forms: the shared-memory all-reduce's join (a collective) is not tried
    monkeypatch.setenv(parallel_state.CPU_ALLREDUCE_ENV, "gloo")
    store = torch.distributed.HashStore()  # no rank 0 to meet: only the join's arguments count
    parallel_state.init_tensor_parallel(
        1, 2, store, device=device, timeout_s=5, startup_timeout_s=5
    )
    assert joined["backend"] == backend == parallel_state.backend_for(device)
    assert (joined["rank"], joined["world_size"]) == (1, 2)
    # NCCL's communicator binds to the current CUDA device: the rank's own, set before joining
    assert current == ([device] if device.type == "cuda" else [])


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_row_parallel_sum_reduces_full_width_outputs_on_the_rank_device(group, device):
    layer = RowParallelLinear(2 * HIDDEN, HIDDEN, TPShard(0, 2), bias=False).to(device)
    assert layer.weight.shape == (HIDDEN, HIDDEN)  # half of the input columns
    out = layer(torch.zeros(TOKENS, HIDDEN, device=device))
    assert out.shape == (TOKENS, HIDDEN)
    assert group.calls == [("all_reduce", (TOKENS, HIDDEN), device)]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_vocab_parallel_embedding_reduces_one_row_per_token(group, device):
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, TPShard(1, 2)).to(device)
    assert embed.weight.shape == (160, HIDDEN)
    ids = torch.tensor([0, 159, 160, 299, 7], device=device)
    assert embed(ids).shape == (TOKENS, HIDDEN)
    assert group.calls == [("all_reduce", (TOKENS, HIDDEN), device)]


def test_the_lm_head_gathers_rank_parts_in_order_cut_to_the_vocabulary(group):
    head = ParallelLMHead(VOCAB, HIDDEN, TPShard(0, 2))
    assert head.weight.shape == (160, HIDDEN)
    logits = head(torch.zeros(TOKENS, HIDDEN))
    assert group.calls == [("gather", (TOKENS, 160), "cpu")]
    # rank 0's 160 columns, then rank 1's up to the vocabulary (its 20 padding rows cut)
    assert logits.shape == (TOKENS, VOCAB)
    assert (logits[:, :160] == 0).all() and (logits[:, 160:] == 1).all()


def test_the_lm_head_gather_stays_on_the_rank_device(group):
    head = ParallelLMHead(VOCAB, HIDDEN, TPShard(0, 2)).to("meta")
    logits = head(torch.zeros(TOKENS, HIDDEN, device="meta"))
    assert (logits.shape, logits.device.type) == ((TOKENS, VOCAB), "meta")


def test_a_worker_rank_sends_its_lm_head_part_and_gets_no_logits(group):
    group.rank = 1
    head = ParallelLMHead(VOCAB, HIDDEN, TPShard(1, 2))
    assert head(torch.zeros(TOKENS, HIDDEN)) is None
    assert group.calls == [("gather", (TOKENS, 160), "cpu")]
