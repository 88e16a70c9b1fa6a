"""Linear layers over weights packed once into column panels for the Rust kernel
(`kernels/cpu_linear.py`, `rust/src/cpu/linear.rs`) against `F.linear`, their torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bf16_tiles import avx512_bf16

from pagedllm import _core
from pagedllm.distributed.layers import Linear
from pagedllm.kernels import cpu_linear
from pagedllm.kernels.cpu_arrays import numpy_view


def _case(rows: int, in_features: int, out_features: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    return x, weight, bias


# every register-tile height (1-6 rows) and the tiles after it, a prefill-sized count, no rows
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear(rows, bias):
    # odd sizes: the last panel of 16 output columns is padded
    x, weight, b = _case(rows, 37, 45, seed=rows)
    b = b if bias else None
    out = cpu_linear.linear(x, weight, b, cpu_linear.pack(weight))
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_rows_beyond_one_block_of_x_equal_f_linear():
    # K = 2000: the kernel walks the rows in blocks of ~30 that stay in cache; 70 rows take 3
    x, weight, b = _case(70, 2000, 40, seed=1)
    out = cpu_linear.linear(x, weight, b, cpu_linear.pack(weight))
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_sized_rows_equal_the_exact_product_for_either_dtype_and_thread_count(
    dtype, threads
):
    # 233 rows at K = 600: x packed in 2 M blocks with a ragged last tile, K in slices of 256
    # and a ragged one, N = 45 pads the last panel
    x, weight, b = _case(233, 600, 45, seed=9, dtype=dtype)
    packed = cpu_linear.pack(weight)
    out = torch.empty(233, 45, dtype=dtype)
    _core.cpu_linear(numpy_view(x), packed.array, numpy_view(b), numpy_view(out), threads)
    exact = F.linear(x.double(), weight.double(), b.double())
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), exact, rtol=rtol, atol=1e-3)
    for row in (0, 100, 232):
        alone = cpu_linear.linear(x[row : row + 1], weight, b, packed)
        assert torch.equal(alone[0], out[row]), row


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_a_bfloat16_linear_rounds_the_float32_sum_once(rows):
    x, weight, b = _case(rows, 37, 45, seed=rows, dtype=torch.bfloat16)
    out = cpu_linear.linear(x, weight, b, cpu_linear.pack(weight))
    assert out.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double(), b.double())
    # one rounding of a float32 sum: within half a bfloat16 ulp (2^-8 relative) and the sum's
    # float32 error
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=2**-7, atol=1e-2)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    x, weight, b = _case(11, 64, 50, seed=3)
    packed = cpu_linear.pack(weight)
    batch = cpu_linear.linear(x, weight, b, packed)
    for row in range(11):
        alone = cpu_linear.linear(x[row : row + 1], weight, b, packed)
        assert torch.equal(alone[0], batch[row]), row


def test_threads_split_the_panels_without_changing_the_output():
    x, weight, b = _case(4, 512, 16 * 40 + 5, seed=4)
    packed = cpu_linear.pack(weight)
    one = torch.empty(4, weight.shape[0])
    three = torch.empty(4, weight.shape[0])
    _core.cpu_linear(x.numpy(), packed.array, b.numpy(), one.numpy(), 1)
    _core.cpu_linear(x.numpy(), packed.array, b.numpy(), three.numpy(), 3)
    assert torch.equal(one, three)
    torch.testing.assert_close(one, F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_leading_dimensions_of_the_input_are_kept():
    x, weight, b = _case(6, 24, 20, seed=5)
    x = x.view(2, 3, 24)
    out = cpu_linear.linear(x, weight, b, cpu_linear.pack(weight))
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_an_input_of_another_dtype_than_the_weight_is_refused():
    x, weight, _ = _case(2, 24, 20, seed=6)
    with pytest.raises(TypeError, match="does not match the layer's weight"):
        cpu_linear.linear(x.to(torch.bfloat16), weight, None, cpu_linear.pack(weight))


def test_the_kernel_names_a_shape_that_does_not_fit():
    x, weight, _ = _case(2, 24, 20, seed=7)
    packed = cpu_linear.pack(weight)
    with pytest.raises(ValueError, match="out has shape"):
        _core.cpu_linear(x.numpy(), packed.array, None, np.zeros((2, 40), np.float32), 1)
    with pytest.raises(ValueError, match="weight panels have shape"):
        wide = np.zeros((2, 25), np.float32)
        _core.cpu_linear(wide, packed.array, None, np.zeros((2, 20), np.float32), 1)
    with pytest.raises(TypeError, match="panels must be a 3-D float32"):
        _core.cpu_linear(x.numpy(), packed.array.astype(np.float64), None, x.numpy(), 1)


def test_unpack_gives_the_weight_back():
    _, weight, _ = _case(1, 37, 45, seed=8)
    assert torch.equal(cpu_linear.unpack(cpu_linear.pack(weight)), weight)


def test_packing_frees_a_layers_own_weight_and_keeps_its_output():
    layer = Linear(40, 96, bias=True)
    x = torch.randn(7, 40)
    expected = layer(x).detach()
    assert cpu_linear.pack_linears(layer) == 1
    assert layer.packed is not None and layer.weight.numel() == 0
    assert layer.weight.dtype == torch.float32
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_a_weight_another_module_shares_is_packed_but_kept():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(96, 40)
    model.head = Linear(40, 96, bias=False)
    model.head.weight = model.embed.weight  # tied, as lm_head and embed_tokens may be
    assert cpu_linear.pack_linears(model) == 1
    assert model.head.packed is not None
    assert model.head.weight is model.embed.weight and model.embed.weight.numel() == 96 * 40
    x = torch.randn(3, 40)
    torch.testing.assert_close(model.head(x), F.linear(x, model.embed.weight))


def test_bfloat16_layers_are_packed_too():
    layer = Linear(40, 96, bias=False).to(torch.bfloat16)
    assert cpu_linear.pack_linears(layer) == 1
    assert layer.packed is not None and layer.packed.panels.dtype == torch.bfloat16


def test_weights_the_kernel_does_not_take_keep_f_linear():
    layer = Linear(40, 96, bias=False).to(torch.float16)
    assert cpu_linear.pack_linears(layer) == 0
    assert layer.packed is None and layer.weight.numel() == 96 * 40


def test_a_packed_layers_state_dict_holds_its_weight_unpacked():
    layer = Linear(40, 95, bias=True)
    expected = {name: t.clone() for name, t in layer.state_dict().items()}
    cpu_linear.pack_linears(layer)
    state = layer.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_bfloat16_weights_are_grouped_where_avx512_bf16_reads_them_and_plain_elsewhere():
    weight = torch.randn(128, 96).bfloat16()
    g = 4 if avx512_bf16() else 1
    assert cpu_linear.pack(weight).panels.shape == (8 // g, 96, 16 * g)
    assert cpu_linear.pack(weight.float()).panels.shape == (8, 96, 16)  # float32 stays plain
    assert cpu_linear.pack(weight[:120]).panels.shape == (8 // g, 96, 16 * g)
    assert cpu_linear.pack(weight[:100]).panels.shape == (7, 96, 16)  # not whole groups
    assert cpu_linear.pack(weight[:, :95]).panels.shape == (8, 95, 16)  # an odd depth
    assert _core.cpu_panel_group("bfloat16", 8, 96) == g
    with pytest.raises(ValueError, match="float16"):
        _core.cpu_panel_group("float16", 8, 96)


@pytest.mark.parametrize("rows", [1, 4, 6, 7, 8, 12, 16, 17, 64])
def test_grouped_bfloat16_panels_give_the_plain_panels_bits_and_unpack_to_the_weight(rows):
    # two groups of panels, K over two slices of the kernel's K blocks; a bias
    x, weight, b = _case(rows, 600, 120, seed=rows, dtype=torch.bfloat16)
    packed = cpu_linear.pack(weight)
    assert torch.equal(cpu_linear.unpack(packed), weight)
    plain = cpu_linear.plain(packed.panels).contiguous()
    as_plain = cpu_linear.PackedWeight(plain, 120, numpy_view(plain))
    got = cpu_linear.linear(x, weight, b, packed)
    assert torch.equal(got, cpu_linear.linear(x, weight, b, as_plain))
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), rtol=2e-2, atol=0.5)


def test_grouped_panels_the_process_does_not_read_are_refused():
    # float32 panels are never grouped: such an array is not a weight's panels
    x, weight, _ = _case(2, 64, 64, seed=3)
    bad = torch.zeros(1, 64, 64)
    out = torch.empty(2, 64)
    with pytest.raises(ValueError, match="groups of 4 panels are not read here"):
        _core.cpu_linear(numpy_view(x), numpy_view(bad), None, numpy_view(out), 1)
