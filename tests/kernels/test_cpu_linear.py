"""Linear layers over weights packed once for oneDNN (`kernels/cpu_linear.py`) against
`F.linear`, their torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed.layers import Linear
from pagedllm.kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("rows", [0, 1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    out = cpu_linear.linear(x, weight, b, cpu_linear.pack(weight))
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_packing_frees_a_layers_own_weight_and_keeps_its_output():
    layer = Linear(40, 96, bias=True)
    x = torch.randn(7, 40)
    expected = layer(x)
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


def test_weights_onednn_cannot_pack_keep_f_linear():
    layer = Linear(40, 96, bias=False).to(torch.bfloat16)
    assert cpu_linear.pack_linears(layer) == 0
    assert layer.packed is None and layer.weight.numel() == 96 * 40


def test_a_packed_layers_state_dict_holds_its_weight_unpacked():
    layer = Linear(40, 96, bias=True)
    expected = {name: t.clone() for name, t in layer.state_dict().items()}
    cpu_linear.pack_linears(layer)
    state = layer.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
