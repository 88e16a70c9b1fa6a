"""`attention/key_transform.py`: a quantized cache's key transform keeps attention exact in
float (the softmax ignores `q . c`), and the query scale is the reciprocal of its kv head's."""

import pytest
import torch

from pagedllm.attention.key_transform import KeyTransform
from pagedllm.attention.paged import AttentionMetadata, LayerAttention, paged_attention

H, KVH, D, BLOCK = 4, 2, 16, 4


def _meta(start: int, n: int) -> AttentionMetadata:
    """One sequence: `n` new tokens at positions start..start+n-1 in blocks 0, 1, ..."""
    total = start + n
    return AttentionMetadata(
        slot_mapping=torch.arange(start, total, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([total], dtype=torch.int32),
        block_tables=torch.arange(-(-total // BLOCK), dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=total,
        is_decode_only=n == 1,
    )


def _attend(transform, layer, q, k, v):
    """A 9-token prefill then one decode over a float cache: both steps' outputs."""
    caches = [torch.zeros(4, BLOCK, KVH, D) for _ in range(2)]
    outs = []
    for start, stop in [(0, 9), (9, 10)]:
        qs, ks = q[start:stop].clone(), k[start:stop].clone()
        if transform is not None:
            transform.apply_(qs, ks)
        meta = _meta(start, stop - start)
        outs.append(paged_attention(qs, ks, v[start:stop], *caches, meta, layer))
    return torch.cat(outs)


def _transform(offset: bool) -> KeyTransform:
    g = torch.Generator().manual_seed(1)
    scale = torch.rand(KVH, D, generator=g) * 3 + 0.2
    c = torch.randn(KVH, D, generator=g) * 2 if offset else None
    return KeyTransform.of(scale, c, H)


def _qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(10, H, D, generator=g)
    k = torch.randn(10, KVH, D, generator=g) + torch.randn(1, KVH, D, generator=g) * 3
    return q, k, torch.randn(10, KVH, D, generator=g)


@pytest.mark.parametrize("offset", [True, False], ids=["scale_and_offset", "scale"])
def test_attention_with_the_transform_equals_attention_without_in_a_float_cache(offset):
    layer = LayerAttention(D**-0.5)
    q, k, v = _qkv()
    want = _attend(None, layer, q, k, v)
    got = _attend(_transform(offset), layer, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_scale_alone_keeps_soft_capped_scores_exact():
    layer = LayerAttention(D**-0.5, softcap=5.0)
    q, k, v = _qkv()
    want = _attend(None, layer, q, k, v)
    got = _attend(_transform(offset=False), layer, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_query_head_is_scaled_by_the_reciprocal_of_its_kv_heads_scale():
    t = _transform(offset=True)
    assert t.query_scale.shape == (H, D)
    for h in range(H):
        torch.testing.assert_close(t.query_scale[h], 1.0 / t.scale[h // (H // KVH)])


def test_query_heads_not_a_multiple_of_the_kv_heads_are_a_value_error():
    with pytest.raises(ValueError, match="num_heads"):
        KeyTransform.of(torch.ones(KVH, D), None, 3)
