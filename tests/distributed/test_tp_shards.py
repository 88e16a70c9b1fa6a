"""Each rank's shard is its slice of the checkpoint (read without torch.distributed: loading
needs no collective), with KV heads replicated and the vocabulary padded as vLLM does."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.layers import TPShard
from pagedllm.models import load_model

from model_factory import save_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2_one_kv_head(tmp_path_factory):
    # vocab 300: padded to 320, so rank 1 holds 20 padding rows
    folder = tmp_path_factory.mktemp("qwen2_kv1")
    return save_tiny_checkpoint(
        folder, "qwen2", num_key_value_heads=1, vocab_size=300, tokenizer=None, seed=5
    )


def _load(folder, rank: int, size: int):
    return load_model(folder, dtype="float32", device="cpu", tp=TPShard(rank, size))


def test_each_rank_holds_its_q_heads_and_a_replica_of_the_kv_head(qwen2_one_kv_head):
    full = _load(qwen2_one_kv_head, 0, 1).model.layers[0].self_attn
    q, k, v = full.qkv_proj.split(full.qkv_proj.weight.T)
    qb, kb, vb = full.qkv_proj.split(full.qkv_proj.bias)
    half = q.shape[1] // 2
    for rank in (0, 1):
        attn = _load(qwen2_one_kv_head, rank, 2).model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        mq, mk, mv = attn.qkv_proj.split(attn.qkv_proj.weight.T)
        torch.testing.assert_close(mq, q[:, rank * half : (rank + 1) * half], rtol=0, atol=0)
        torch.testing.assert_close(mk, k, rtol=0, atol=0)
        torch.testing.assert_close(mv, v, rtol=0, atol=0)
        mqb, mkb, _ = attn.qkv_proj.split(attn.qkv_proj.bias)
        torch.testing.assert_close(mqb, qb[rank * half : (rank + 1) * half], rtol=0, atol=0)
        torch.testing.assert_close(mkb, kb, rtol=0, atol=0)


def test_row_parallel_layers_hold_their_input_columns(qwen2_one_kv_head):
    full = _load(qwen2_one_kv_head, 0, 1).model.layers[1].mlp.down_proj.weight
    shard = _load(qwen2_one_kv_head, 1, 2).model.layers[1].mlp.down_proj.weight
    half = full.shape[1] // 2
    torch.testing.assert_close(shard, full[:, half:], rtol=0, atol=0)


def test_the_vocabulary_is_padded_to_64_with_zero_rows(qwen2_one_kv_head):
    full = _load(qwen2_one_kv_head, 0, 1)
    last = _load(qwen2_one_kv_head, 1, 2)
    embed = last.model.embed_tokens.weight
    assert embed.shape[0] == last.lm_head.weight.shape[0] == 160  # 320 / 2
    torch.testing.assert_close(embed[:140], full.model.embed_tokens.weight[160:], rtol=0, atol=0)
    assert not embed[140:].any()
    torch.testing.assert_close(last.lm_head.weight[:140], full.lm_head.weight[160:], rtol=0, atol=0)
