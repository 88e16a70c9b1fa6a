"""worker/weight_pages.py: the linear layers' packed and quantized weights copied into one
huge-page buffer, the same bytes, a tied embedding following its LM head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import nn

from pagedllm import _core
from pagedllm.distributed.layers import QuantEmbedding
from pagedllm.kernels import cpu_linear, cpu_moe, cpu_quant
from pagedllm.worker import weight_pages
from pagedllm.worker.cache_engine import HUGE_PAGE_BYTES


class Holder(nn.Module):
    """A layer as the engine's: a `packed` or a `quant` slot."""

    def __init__(self, packed=None, quant=None) -> None:
        super().__init__()
        self.packed, self.quant = packed, quant


def _start(weight) -> int:
    if isinstance(weight, cpu_linear.PackedWeight):
        return weight.panels.data_ptr()
    return weight.segments[0].data.data_ptr()


def _model(rows: int = 1024) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    dense = torch.randn(rows, 512)
    quant = torch.randn(rows, 512)
    model = nn.Module()
    model.a = Holder(packed=cpu_linear.pack(dense))
    model.b = Holder(quant=cpu_quant.quantize(quant, cpu_quant.Q8_0))
    return model, dense, quant


def test_moved_layers_compute_the_same_products_from_one_buffer():
    model, dense, _ = _model()
    x = torch.randn(3, 512)
    before = (
        cpu_linear.linear(x, dense, None, model.a.packed),
        cpu_quant.quant_linear(x, model.b.quant, None),
    )
    old = (_start(model.a.packed), _start(model.b.quant))
    moved = weight_pages.move_weights(model)
    assert moved >= dense.numel() * 4 + model.b.quant.segments[0].data.numel()
    new = (_start(model.a.packed), _start(model.b.quant))
    assert set(new).isdisjoint(old)
    # one buffer, the weights side by side
    assert abs(new[1] - new[0]) < moved
    assert torch.equal(cpu_linear.linear(x, dense, None, model.a.packed), before[0])
    assert torch.equal(cpu_quant.quant_linear(x, model.b.quant, None), before[1])


def test_float_experts_panels_move_onto_huge_pages_with_the_same_results():
    torch.manual_seed(0)
    experts, hidden, width = 16, 256, 128  # 3 MiB of panels
    gate_up = torch.randn(experts, 2 * width, hidden).to(torch.bfloat16)
    down = torch.randn(experts, hidden, width).to(torch.bfloat16)
    model = nn.Module()
    model.experts = Holder(packed=cpu_moe.pack_experts(gate_up, down))
    old = model.experts.packed
    x = torch.randn(5, hidden).to(torch.bfloat16)
    ids = torch.tensor([[e % experts, (e + 3) % experts] for e in range(5)])
    weights = torch.rand(5, 2)
    before = cpu_moe.moe_experts(x, old, weights, ids)
    assert weight_pages.move_weights(model) == old.gate_up.nbytes + old.down.nbytes
    new = model.experts.packed
    assert new.gate_up.data_ptr() % HUGE_PAGE_BYTES == 0
    assert torch.equal(new.gate_up, old.gate_up) and torch.equal(new.down, old.down)
    assert torch.equal(cpu_moe.moe_experts(x, new, weights, ids), before)


def test_a_tied_embedding_follows_its_lm_head_and_an_untied_one_stays():
    model, _, quant = _model()
    tied = model.b.quant
    untied = cpu_quant.quantize(quant, cpu_quant.Q8_0)
    model.tied = QuantEmbedding(tied)
    model.untied = QuantEmbedding(untied)
    weight_pages.move_weights(model)
    assert model.tied.quant is model.b.quant
    assert model.b.quant is not tied
    assert model.untied.quant is untied


def test_less_than_a_huge_page_of_weights_is_left_in_place():
    model, _, _ = _model(rows=64)
    packed = model.a.packed
    assert packed.panels.nbytes < HUGE_PAGE_BYTES
    assert weight_pages.move_weights(model) == 0
    assert model.a.packed is packed


def _quantized_model(qtype: int, rows: int = 8192) -> nn.Module:  # more than a huge page
    torch.manual_seed(1)
    weight = torch.randn(rows, 576)
    if qtype == cpu_quant.Q4_0:
        quant = cpu_quant.quantize(weight, qtype)
    else:  # ggml's reference rounding (the engine quantizes only to Q8_0 / Q4_0)
        data = gguf_quants.quantize(weight.numpy(), GGMLQuantizationType(qtype))
        data = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1))
        quant = cpu_quant.make_weight([(qtype, data)], 576)
    model = nn.Module()
    model.b = Holder(quant=quant)
    model.tied = QuantEmbedding(model.b.quant)
    return model


@pytest.mark.parametrize(
    ("qtype", "repacked"),
    [
        (cpu_quant.Q4_0, weight_pages.Q4_0_REPACKED),
        (cpu_quant.Q5_0, weight_pages.Q5_0_REPACKED),
        (cpu_quant.Q8_0, weight_pages.Q8_0_REPACKED),
        (cpu_quant.Q4_1, weight_pages.Q4_1_REPACKED),
    ],
)
def test_rows_are_repacked_where_the_vnni_products_read_them_with_the_same_results(qtype, repacked):
    model = _quantized_model(qtype)
    x1, x4, x20 = torch.randn(1, 576), torch.randn(4, 576), torch.randn(20, 576)
    ids = torch.tensor([0, 8191, 17])
    w = model.b.quant
    before = [cpu_quant.quant_linear(x, w, None, activations="int16") for x in (x1, x4, x20)]
    before += [cpu_quant.quant_linear(x1, w, None), cpu_quant.embedding(ids, w)]
    weight_pages.move_weights(model)
    w = model.b.quant
    level, flags = _core.cpu_isa()
    vnni = level in ("avx512", "amx") and "avx512vnni" in flags
    assert w.segments[0].qtype == (repacked if vnni else qtype)
    assert model.tied.quant is w
    after = [cpu_quant.quant_linear(x, w, None, activations="int16") for x in (x1, x4, x20)]
    after += [cpu_quant.quant_linear(x1, w, None), cpu_quant.embedding(ids, w)]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_the_repack_switch_off_copies_q4_0_rows_as_they_are(monkeypatch):
    monkeypatch.setattr(weight_pages, "REPACK", False)
    model = _quantized_model(cpu_quant.Q4_0)
    data = model.b.quant.segments[0].data.clone()
    weight_pages.move_weights(model)
    assert model.b.quant.segments[0].qtype == cpu_quant.Q4_0
    assert torch.equal(model.b.quant.segments[0].data, data)
