"""The grouped mixture-of-experts kernel (`kernels.cpu_moe`, rust/src/cpu/moe.rs) against its
torch reference (`kernels.moe_reference`, transformers' per-expert loop)."""

from __future__ import annotations

import pytest
import torch
from bf16_tiles import avx512_bf16
from torch import Tensor

from pagedllm import _core
from pagedllm.kernels import cpu_moe
from pagedllm.kernels.cpu_arrays import numpy_view
from pagedllm.kernels.moe_reference import moe_experts_reference

HIDDEN, WIDTH, EXPERTS = 40, 24, 8  # widths that leave partial panels


def experts(dtype=torch.float32, seed: int = 0, hidden: int = HIDDEN, width: int = WIDTH):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * width, hidden, generator=g) / hidden**0.5
    down = torch.randn(EXPERTS, hidden, width, generator=g) / width**0.5
    return gate_up.to(dtype), down.to(dtype)


def routing(tokens: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return weights, ids


def run_both(x, gate_up, down, weights, ids):
    packed = cpu_moe.pack_experts(gate_up, down)
    return (
        cpu_moe.moe_experts(x, packed, weights, ids),
        moe_experts_reference(x, gate_up, down, weights, ids),
    )


@pytest.mark.parametrize("tokens", [1, 7, 40], ids=["decode", "batch", "prefill"])
@pytest.mark.parametrize("k", [2, 8])
def test_grouped_kernel_matches_the_torch_loop_in_float32(tokens, k):
    gate_up, down = experts()
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    got, want = run_both(x, gate_up, down, *routing(tokens, k))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9, 70], ids=["decode", "batch", "prefill"])
def test_grouped_kernel_matches_the_torch_loop_in_bfloat16_within_its_rounding(tokens):
    # 70 tokens x 4 of 8 experts: tiles of 8 rows and the 4 / 2 / 1-row remainders (the
    # vdpbf16ps tiles on a CPU with AVX-512 BF16)
    gate_up, down = experts(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    got, want = run_both(x, gate_up, down, *routing(tokens, 4))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_bfloat16_experts_of_odd_widths_match_the_torch_loop():
    # an odd hidden size and width: each product's last inner element has no pair
    g = torch.Generator().manual_seed(4)
    hidden, width = 37, 21
    gate_up = (torch.randn(EXPERTS, 2 * width, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(EXPERTS, hidden, width, generator=g) / width**0.5).bfloat16()
    x = torch.randn(19, hidden, generator=g).bfloat16()
    got, want = run_both(x, gate_up, down, *routing(19, 3))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_bfloat16_tokens_output_does_not_depend_on_its_batch():
    gate_up, down = experts(torch.bfloat16)
    packed = cpu_moe.pack_experts(gate_up, down)
    weights, ids = routing(30, 4)
    x = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(6)).bfloat16()
    batch = cpu_moe.moe_experts(x, packed, weights, ids)
    for t in (0, 13, 29):
        alone = cpu_moe.moe_experts(x[t : t + 1], packed, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


def test_experts_no_token_chose_are_never_read():
    # the unchosen experts hold NaN: any read of them would poison the output
    gate_up, down = experts()
    weights, ids = routing(6, 2)
    ids = ids % 3  # experts 0-2 only (a token may choose one twice: both terms count)
    for e in range(3, EXPERTS):
        gate_up[e], down[e] = float("nan"), float("nan")
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
    got, want = run_both(x, gate_up, down, weights, ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_expert_chosen_by_every_token():
    gate_up, down = experts()
    weights, ids = routing(20, 2)
    ids[:, 0] = 5
    ids[:, 1] = torch.where(ids[:, 1] == 5, 0, ids[:, 1])
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(5))
    got, want = run_both(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tokens_output_does_not_depend_on_its_batch():
    gate_up, down = experts()
    packed = cpu_moe.pack_experts(gate_up, down)
    weights, ids = routing(12, 3)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(6))
    batch = cpu_moe.moe_experts(x, packed, weights, ids)
    for t in (0, 11):
        alone = cpu_moe.moe_experts(x[t : t + 1], packed, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t])


def test_packing_round_trips():
    gate_up, down = experts()
    back = cpu_moe.unpack_experts(cpu_moe.pack_experts(gate_up, down))
    assert torch.equal(back[0], gate_up) and torch.equal(back[1], down)


def test_an_expert_id_outside_the_experts_is_a_value_error_naming_it():
    gate_up, down = experts()
    weights, ids = routing(2, 2)
    ids[1, 0] = EXPERTS
    with pytest.raises(ValueError, match=f"expert id {EXPERTS} is outside 0..{EXPERTS}"):
        cpu_moe.moe_experts(
            torch.zeros(2, HIDDEN), cpu_moe.pack_experts(gate_up, down), weights, ids
        )


def test_two_halves_of_the_experts_with_the_other_half_not_held_sum_to_the_whole():
    # expert parallelism over two ranks: each holds 4 experts and skips the choices of the
    # other's (NOT_HELD); the two partial outputs add up to one rank's
    gate_up, down = experts()
    weights, ids = routing(7, 4)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(4))
    whole = moe_experts_reference(x, gate_up, down, weights, ids)
    halves = []
    for first in (0, 4):
        local = ids - first
        held = local.masked_fill((local < 0) | (local >= 4), cpu_moe.NOT_HELD)
        halves.append(
            run_both(x, gate_up[first : first + 4], down[first : first + 4], weights, held)
        )
    for kernel_or_loop in (0, 1):
        total = halves[0][kernel_or_loop] + halves[1][kernel_or_loop]
        torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_quantized_experts_match_the_torch_loop_on_their_dequantized_weights():
    from pagedllm.kernels import cpu_quant

    # Q8_0 rows: widths on its blocks of 32
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(EXPERTS, 64, 64, generator=g) / 8
    down = torch.randn(EXPERTS, 64, 32, generator=g) / 6
    quant = [
        [cpu_quant.quantize(w, cpu_quant.Q8_0) for w in weights] for weights in (gate_up, down)
    ]
    dequantized = [torch.stack([cpu_quant.dequantize(w) for w in ws]) for ws in quant]
    weights, ids = routing(7, 4)
    ids[3, 1] = cpu_moe.NOT_HELD  # another rank's expert: adds nothing
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    packed = cpu_moe.QuantExperts.of(*quant)
    got = cpu_moe.moe_quant_experts(x, packed, weights, ids, activations="f32")
    want = moe_experts_reference(x, *dequantized, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_quantized_experts_of_stacked_tensors_are_read_in_place_and_equal_a_copy():
    import numpy as np

    from pagedllm.kernels import cpu_quant

    # a GGUF file's layout: each projection's experts one stacked tensor, an expert a block of
    # its rows (gate and up separate tensors)
    g = torch.Generator().manual_seed(7)
    stacked = {
        name: cpu_quant.quantize(torch.randn(EXPERTS * rows, cols, generator=g) / 8, cpu_quant.Q8_0)
        for name, rows, cols in (("gate", 32, 64), ("up", 32, 64), ("down", 64, 32))
    }
    data = {name: w.segments[0].data for name, w in stacked.items()}

    def block(name, e, rows):
        return (cpu_quant.Q8_0, data[name][e * rows : (e + 1) * rows])

    gate_up = [
        cpu_quant.make_weight([block("gate", e, 32), block("up", e, 32)], 64)
        for e in range(EXPERTS)
    ]
    down = [cpu_quant.make_weight([block("down", e, 64)], 32) for e in range(EXPERTS)]
    in_place = cpu_moe.QuantExperts.of(gate_up, down)
    assert 1 <= len(in_place.buffers) <= 3  # one run of memory per stacked tensor at most
    for buffer in in_place.buffers:
        assert any(np.shares_memory(buffer, d.numpy()) for d in data.values())
    # the same bytes scattered over an allocation per segment: copied into one buffer
    scattered = [
        [
            cpu_quant.make_weight([(s.qtype, s.data.clone()) for s in w.segments], w.in_features)
            for w in ws
        ]
        for ws in (gate_up, down)
    ]
    copied = cpu_moe.QuantExperts.of(*scattered)
    assert len(copied.buffers) == 1
    assert not any(np.shares_memory(copied.buffers[0], d.numpy()) for d in data.values())
    for tokens in (1, 7):
        weights, ids = routing(tokens, 4)
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
        got = cpu_moe.moe_quant_experts(x, in_place, weights, ids)
        want = cpu_moe.moe_quant_experts(x, copied, weights, ids)
        assert torch.equal(got, want), f"{tokens} tokens"


def test_quantized_experts_copied_onto_a_buffer_read_it_and_give_the_same_outputs():
    from pagedllm.kernels import cpu_quant

    g = torch.Generator().manual_seed(8)
    quant = [
        [cpu_quant.quantize(torch.randn(rows, cols, generator=g) / 8, cpu_quant.Q8_0)]
        * EXPERTS  # every expert the same weight object: a copy must still hold each one's rows
        for rows, cols in ((64, 64), (64, 32))
    ]
    experts_ = cpu_moe.QuantExperts.of(*quant)
    buffer = torch.zeros(experts_.nbytes, dtype=torch.uint8)
    moved = experts_.onto(buffer)
    assert len(moved.buffers) == 1 and moved.buffers[0].ctypes.data == buffer.data_ptr()
    weights, ids = routing(5, 3)
    x = torch.randn(5, 64, generator=g)
    want = cpu_moe.moe_quant_experts(x, experts_, weights, ids)
    assert torch.equal(cpu_moe.moe_quant_experts(x, moved, weights, ids), want)
    with pytest.raises(ValueError, match="needs a uint8"):
        experts_.onto(torch.zeros(experts_.nbytes - 1, dtype=torch.uint8))


def quantized(weight: torch.Tensor, qtype: int):
    """`weight` in `qtype` with ggml's reference rounding (the `gguf` package's)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from pagedllm.kernels import cpu_quant

    data = gguf_quants.quantize(weight.numpy(), GGMLQuantizationType(qtype))
    data = np.ascontiguousarray(data).view(np.uint8).reshape(weight.shape[0], -1)
    return cpu_quant.make_weight([(qtype, torch.from_numpy(data))], weight.shape[1])


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_experts_repacked_onto_a_buffer_give_the_same_outputs_bit_for_bit(qtype_name):
    from pagedllm import _core
    from pagedllm.kernels import cpu_quant

    qtype = getattr(cpu_quant, qtype_name)
    g = torch.Generator().manual_seed(9)
    # k = 256 and 288: whole groups of 8 blocks, and a last group of 1
    hidden, width = 256, 288
    quant = [
        [quantized(torch.randn(rows, cols, generator=g) / 8, qtype) for _ in range(EXPERTS)]
        for rows, cols in ((2 * width, hidden), (hidden, width))
    ]
    experts_ = cpu_moe.QuantExperts.of(*quant)
    moved = experts_.onto(torch.zeros(experts_.nbytes, dtype=torch.uint8), repack=True)
    level, flags = _core.cpu_isa()
    vnni = level in ("avx512", "amx") and "avx512vnni" in flags
    types = {s.qtype for w in [*moved.gate_up, *moved.down] for s in w.segments}
    repacks = vnni and qtype != cpu_quant.Q5_1  # Q5_1 has no repacked layout
    assert len(types) == 1 and (types != {qtype}) == repacks
    for tokens, activations in ((1, "int16"), (6, "int16"), (40, "int16"), (3, "f32")):
        weights, ids = routing(tokens, 3)
        x = torch.randn(tokens, hidden, generator=g)
        want = cpu_moe.moe_quant_experts(x, experts_, weights, ids, activations)
        got = cpu_moe.moe_quant_experts(x, moved, weights, ids, activations)
        assert torch.equal(got, want), f"{tokens} tokens, {activations}"


def test_bfloat16_experts_are_grouped_where_avx512_bf16_reads_them_and_plain_elsewhere():
    grouped = cpu_moe.pack_experts(*experts(torch.bfloat16, seed=8, hidden=64, width=32))
    plain = cpu_moe.pack_experts(*experts(seed=8, hidden=64, width=32))
    assert plain.gate_up.shape == (EXPERTS, 4, 64, 16)  # float32 panels stay plain
    g = 4 if avx512_bf16() else 1
    assert grouped.gate_up.shape == (EXPERTS, 4 // g, 64, 16 * g)
    assert grouped.down.shape == (EXPERTS, 4 // g, 32, 16 * g)
    assert _core.cpu_panel_group("bfloat16", 6, 64) == 1  # not whole groups
    assert _core.cpu_panel_group("bfloat16", 4, 63) == 1  # an odd depth
    with pytest.raises(ValueError, match="float16"):
        _core.cpu_panel_group("float16", 4, 64)


def test_grouped_bfloat16_experts_give_the_plain_panels_bits_and_unpack_to_the_weights():
    gate_up, down = experts(torch.bfloat16, seed=9, hidden=64, width=32)
    packed = cpu_moe.pack_experts(gate_up, down)
    unpacked = cpu_moe.unpack_experts(packed)
    assert torch.equal(unpacked[0], gate_up) and torch.equal(unpacked[1], down)

    def plain(w: Tensor) -> Tensor:  # [E, N, K] -> [E, N / 16, K, 16]
        return w.view(EXPERTS, w.shape[1] // 16, 16, w.shape[2]).transpose(2, 3).contiguous()

    as_plain = cpu_moe.PackedExperts(
        plain(gate_up), plain(down), 32, 64, numpy_view(plain(gate_up)), numpy_view(plain(down))
    )
    for tokens in (1, 8, 13, 40):
        weights, ids = routing(tokens, 4)
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        got = cpu_moe.moe_experts(x, packed, weights, ids)
        assert torch.equal(got, cpu_moe.moe_experts(x, as_plain, weights, ids)), tokens
