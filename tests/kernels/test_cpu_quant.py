"""The quantized-weight CPU kernels (`kernels/cpu_quant.py`, `rust/src/cpu/quant/`) against the
`gguf` package: its `dequantize` is the reference for every type, its `quantize` for Q8_0 and
Q4_0 (the types it cannot quantize get random valid blocks: random bytes, sane f16 scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from pagedllm import _core
from pagedllm.kernels import cpu_quant

TYPES = sorted(cpu_quant.SUPPORTED)
# byte offsets of the f16 scales of the types whose blocks are made from random bytes
_SCALES = {cpu_quant.Q4_K: (0, 2), cpu_quant.Q5_K: (0, 2), cpu_quant.Q6_K: (208,)}


def _rows(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """`n` rows of `k` elements of `qtype` as uint8 [n, row_bytes]."""
    rng = np.random.default_rng(seed)
    gtype = GGMLQuantizationType(qtype)
    if qtype in _SCALES:
        elems, size = cpu_quant.block_shape(qtype)
        blocks = rng.integers(0, 256, size=(n * k // elems, size), dtype=np.uint8)
        for at in _SCALES[qtype]:
            scale = rng.uniform(-0.02, 0.02, size=blocks.shape[0]).astype(np.float16)
            blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(n, -1)
    data = rng.standard_normal((n, k)).astype(np.float32)
    return np.ascontiguousarray(gguf_quants.quantize(data, gtype)).view(np.uint8).reshape(n, -1)


def _reference(qtype: int, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(rows, GGMLQuantizationType(qtype)).copy())


def _assert_float32_close(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias=None):
    """`got` equals `x @ dense.T (+ bias)` within float32 summation error: a few ulp of the sum
    of the terms' magnitudes (the order of the sums differs from torch's)."""
    exact = x.double() @ dense.double().T
    if bias is not None:
        exact = exact + bias.double()
    bound = 4e-7 * (x.double().abs() @ dense.double().abs().T) + 1e-6
    assert got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= bound).all()), (got.double() - exact).abs().max()


def _weight(parts: list[tuple[int, np.ndarray]], k: int) -> cpu_quant.QuantWeight:
    return cpu_quant.make_weight([(t, torch.from_numpy(r)) for t, r in parts], k)


def _k(qtype: int) -> int:
    # K-quants need rows of whole 256-element super-blocks
    return 512 if qtype in _SCALES else 96


@pytest.mark.parametrize("qtype", TYPES, ids=cpu_quant.type_name)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    k = _k(qtype)
    rows = _rows(qtype, 13, k, seed=qtype)
    got = cpu_quant.dequantize(_weight([(qtype, rows)], k))
    want = _reference(qtype, rows)
    assert got.shape == (13, k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("m", [1, 3, 8, 33, 100])
@pytest.mark.parametrize("qtype", TYPES, ids=cpu_quant.type_name)
def test_quant_linear_equals_x_times_the_dequantized_weight(qtype, m):
    # N = 45: runs of rows that end mid-panel; m = 33, 100 take the prefill path
    k, n = _k(qtype), 45
    rows = _rows(qtype, n, k, seed=qtype + m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = cpu_quant.quant_linear(x, _weight([(qtype, rows)], k), bias)
    _assert_float32_close(got, x, _reference(qtype, rows), bias)


@pytest.mark.parametrize("m", [1, 40])
def test_segments_of_mixed_types_make_one_weight(m):
    # a fused q/k/v of a Q4_K_M file: rows of several types in one call
    k = 512
    parts = [
        (cpu_quant.Q4_K, _rows(cpu_quant.Q4_K, 7, k, 1)),
        (cpu_quant.Q6_K, _rows(cpu_quant.Q6_K, 20, k, 2)),
        (cpu_quant.Q8_0, _rows(cpu_quant.Q8_0, 5, k, 3)),
        (cpu_quant.F16, _rows(cpu_quant.F16, 3, k, 4)),
    ]
    w = _weight(parts, k)
    assert w.out_features == 35
    dense = torch.cat([_reference(t, r) for t, r in parts])
    x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(5))
    got = cpu_quant.quant_linear(x, w, None)
    assert got.shape == (2, m, 35)
    _assert_float32_close(got.view(-1, 35), x.view(-1, k), dense)


@pytest.mark.parametrize("m", [2, 50])
def test_threads_do_not_change_a_rows_result(m):
    k, n = 512, 300
    rows = _rows(cpu_quant.Q4_K, n, k, 6)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    outs = []
    for threads in (1, 2):
        out = torch.empty(m, n)
        _core.cpu_quant_linear(x.numpy(), [(cpu_quant.Q4_K, rows)], None, out.numpy(), threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_embedding_rows_are_the_exact_dequantized_rows():
    k = 64
    rows = _rows(cpu_quant.Q8_0, 10, k, 7)
    ids = torch.tensor([[9, 0, 3], [3, 3, 1]])
    got = cpu_quant.embedding(ids, _weight([(cpu_quant.Q8_0, rows)], k))
    assert torch.equal(got, _reference(cpu_quant.Q8_0, rows)[ids])


def test_an_embedding_id_out_of_range_is_a_value_error():
    w = _weight([(cpu_quant.Q8_0, _rows(cpu_quant.Q8_0, 4, 32, 8))], 32)
    with pytest.raises(ValueError, match="token id 4"):
        cpu_quant.embedding(torch.tensor([4]), w)


@pytest.mark.parametrize("qtype", [cpu_quant.Q8_0, cpu_quant.Q4_0], ids=cpu_quant.type_name)
def test_quantize_is_byte_identical_to_gguf(qtype):
    gen = torch.Generator().manual_seed(qtype)
    weight = torch.randn(37, 256, generator=gen) * torch.rand(37, 1, generator=gen) * 3
    weight[0, :32] = 0.0  # an all-zero block: d = 0
    weight[1, :32] = torch.arange(32) / 4 - 4  # exact halves: the rounding ties
    weight[2, 32:64] = -weight[2, 32:64].abs()  # a block whose extreme value is negative
    w = cpu_quant.quantize(weight, qtype)
    want = gguf_quants.quantize(weight.numpy(), GGMLQuantizationType(qtype))
    assert np.array_equal(w.segments[0].data.numpy(), want)


def test_quantize_to_an_unsupported_type_is_a_value_error():
    with pytest.raises(ValueError, match="Q4_K is not supported"):
        cpu_quant.quantize(torch.zeros(2, 256), cpu_quant.Q4_K)


def test_slice_rows_takes_rows_across_segments():
    k = 64
    parts = [
        (cpu_quant.Q8_0, _rows(cpu_quant.Q8_0, 5, k, 9)),
        (cpu_quant.Q4_1, _rows(cpu_quant.Q4_1, 6, k, 10)),
    ]
    w = _weight(parts, k)
    part = cpu_quant.slice_rows(w, slice(3, 8))
    assert [s.rows for s in part.segments] == [2, 3]
    assert torch.equal(cpu_quant.dequantize(part), cpu_quant.dequantize(w)[3:8])


def test_slice_cols_on_block_boundaries_takes_those_columns():
    k = 512
    parts = [
        (cpu_quant.Q4_K, _rows(cpu_quant.Q4_K, 3, k, 11)),
        (cpu_quant.Q8_0, _rows(cpu_quant.Q8_0, 4, k, 12)),
    ]
    w = _weight(parts, k)
    part = cpu_quant.slice_cols(w, slice(256, 512))
    assert part.in_features == 256
    assert torch.equal(cpu_quant.dequantize(part), cpu_quant.dequantize(w)[:, 256:])


def test_slice_cols_that_cut_a_block_is_a_value_error():
    w = _weight([(cpu_quant.Q4_K, _rows(cpu_quant.Q4_K, 2, 512, 13))], 512)
    with pytest.raises(ValueError, match="cut Q4_K blocks of 256"):
        cpu_quant.slice_cols(w, slice(0, 128))


def test_an_unsupported_type_is_a_value_error_naming_it():
    data = torch.zeros(2, 66, dtype=torch.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        cpu_quant.make_weight([(int(GGMLQuantizationType.IQ2_XXS), data)], 256)
    with pytest.raises(ValueError, match="unsupported ggml type 16"):
        x, out = np.zeros((1, 256), np.float32), np.zeros((1, 2), np.float32)
        _core.cpu_quant_linear(x, [(16, data.numpy())], None, out, 1)


def test_a_wrong_byte_count_is_a_value_error():
    data = torch.zeros(2, 33, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"segment 0 \(Q8_0\) must be uint8 \[rows, 34\]"):
        cpu_quant.make_weight([(cpu_quant.Q8_0, data)], 32)
    with pytest.raises(ValueError, match=r"segment 0 \(Q8_0\) has 66 bytes"):
        _core.cpu_quant_dequantize([(cpu_quant.Q8_0, data.numpy())], np.zeros((2, 32), np.float32))


def test_rows_that_are_not_whole_blocks_are_a_value_error():
    with pytest.raises(ValueError, match="blocks of 256 elements; 300"):
        cpu_quant.row_bytes(cpu_quant.Q6_K, 300)


def test_block_shapes_are_ggmls():
    for qtype in TYPES:
        ggml = gguf_quants.GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        assert cpu_quant.block_shape(qtype) == ggml
