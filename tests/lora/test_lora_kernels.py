"""The LoRA Triton kernels against their torch reference, and the reference against a plain
per-token loop. Without a GPU the kernels run under the Triton interpreter (conftest.py)."""

import numpy as np
import pytest
import torch

from pagedllm.kernels import lora_reference as ref
from pagedllm.kernels.lora import lora_expand, lora_shrink

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 6e-2)]
# 19 tokens: runs of three slots in batch order (not grouped), tokens of no adapter between
TOKEN_SLOTS = np.array([2, 2, -1, 0, 0, 0, 2, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0])


def _weights(shape, dtype, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype)


def _loop(x, a, b, slots, out, r):
    """Plain per-token products: out[t] += (x[t] @ a[s].T)[:r] @ b[s].T for every token's slot."""
    out = out.clone().float()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += (x[t].float() @ a[s].float().t())[:r] @ b[s].float().t()
    return out


def test_segments_group_tokens_by_slot_in_batch_order():
    seg = ref.build_segments(TOKEN_SLOTS, torch.device("cpu"))
    assert seg.seg_slots.tolist() == [0, 1, 2]
    assert seg.seg_starts.tolist() == [0, 4, 13, 16]
    assert seg.token_order.tolist() == [3, 4, 5, 18, *range(9, 18), 0, 1, 6]
    assert seg.max_seg_len == 9 and seg.num_tokens == len(TOKEN_SLOTS)
    assert ref.build_segments(np.full(5, -1), torch.device("cpu")) is None


@pytest.mark.parametrize("slots", [TOKEN_SLOTS, np.full(len(TOKEN_SLOTS), 1)], ids=["mixed", "one"])
def test_reference_matches_a_per_token_loop(slots):
    # "one": every token has the same adapter, the products run without gather/scatter
    x = _weights((len(slots), 40), torch.float32, 1)
    a = _weights((3, 8, 40), torch.float32, 2)
    b = _weights((3, 24, 8), torch.float32, 3)
    out = _weights((len(slots), 30), torch.float32, 4)
    expected = out.clone()
    expected[:, 6:] = _loop(x, a, b, slots, out[:, 6:], 8)
    seg = ref.build_segments(slots, torch.device("cpu"))
    assert (seg.single_slot == 1) == (slots is not TOKEN_SLOTS)
    ref.lora_expand(ref.lora_shrink(x, a, seg), b, seg, out, 0, 6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_kernels_match_reference_on_fused_parts(dtype, tol):
    # a fused q/k/v-like projection: one shrink over the parts' stacked A (3 x rank 8), then one
    # expand per part into its columns of the fused output
    T, K, R = len(TOKEN_SLOTS), 72, 8
    sizes, offsets = [48, 24, 24], [0, 48, 72]
    x = _weights((T, K), dtype, 5).to(DEV)
    a = _weights((3, 3 * R, K), dtype, 6).to(DEV)
    bs = [_weights((3, n, R), dtype, 7 + i).to(DEV) for i, n in enumerate(sizes)]
    out = _weights((T, sum(sizes)), dtype, 11).to(DEV)
    out_ref = out.clone()
    seg = ref.build_segments(TOKEN_SLOTS, torch.device(DEV))
    y = lora_shrink(x, a, seg)
    y_ref = ref.lora_shrink(x, a, seg)
    rows = seg.token_order
    torch.testing.assert_close(y[rows], y_ref[rows], atol=tol, rtol=tol)
    for i, b in enumerate(bs):
        lora_expand(y, b, seg, out, i * R, offsets[i])
        ref.lora_expand(y_ref, b, seg, out_ref, i * R, offsets[i])
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol, rtol=tol)
    untouched = torch.from_numpy(TOKEN_SLOTS < 0).to(DEV)
    assert torch.equal(out[untouched], _weights((T, sum(sizes)), dtype, 11).to(DEV)[untouched])


def test_kernels_handle_segments_longer_than_a_tile_and_a_padded_rank():
    # one adapter over 70 tokens (3 row tiles), rank 5 zero-padded to 16 in the buffers
    slots = np.zeros(70, dtype=np.int64)
    slots[::7] = -1
    x = _weights((70, 33), torch.float32, 12).to(DEV)
    a = torch.zeros(2, 16, 33)
    a[0, :5] = _weights((5, 33), torch.float32, 13)
    b = torch.zeros(2, 20, 16)
    b[0, :, :5] = _weights((20, 5), torch.float32, 14)
    a, b = a.to(DEV), b.to(DEV)
    out = torch.zeros(70, 20, device=DEV)
    seg = ref.build_segments(slots, torch.device(DEV))
    lora_expand(lora_shrink(x, a, seg), b, seg, out, 0, 0)
    expected = _loop(x.cpu(), a.cpu(), b.cpu(), slots, torch.zeros(70, 20), 16)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
