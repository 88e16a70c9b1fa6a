"""The parallel layers with one rank are the plain ones: no collective (torch.distributed is never
initialised), no vocabulary padding; the decoder builds them whatever the rank count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.distributed.layers import (
    ParallelLMHead,
    RowParallelLinear,
    TPShard,
    VocabParallelEmbedding,
)
from pagedllm.models.decoder import Attention, DecoderForCausalLM

ONE = TPShard(0, 1)


def test_a_one_rank_row_parallel_linear_runs_no_collective():
    layer = RowParallelLinear(8, 4, ONE, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 8)
    assert not torch.distributed.is_initialized()
    torch.testing.assert_close(layer.forward(x), F.linear(x, layer.weight, layer.bias))


def test_a_one_rank_vocabulary_is_whole_and_unpadded():
    embedding = VocabParallelEmbedding(100, 8, ONE)
    head = ParallelLMHead(100, 8, ONE)
    assert embedding.weight.shape == head.weight.shape == (100, 8)
    torch.nn.init.normal_(embedding.weight)
    head.weight = embedding.weight
    ids = torch.tensor([0, 42, 99])
    hidden = embedding(ids)
    torch.testing.assert_close(hidden, F.embedding(ids, embedding.weight))
    torch.testing.assert_close(head(hidden), hidden @ embedding.weight.T)


def test_the_decoder_builds_the_parallel_layers_for_one_rank(tmp_path):
    from pagedllm.models import load_model

    from model_factory import save_tiny_checkpoint

    model = load_model(str(save_tiny_checkpoint(tmp_path, "llama", seed=2)), dtype=torch.float32)
    assert isinstance(model, DecoderForCausalLM)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention, Attention)
    assert isinstance(attention.o_proj, RowParallelLinear)
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    assert isinstance(model.lm_head, ParallelLMHead)
