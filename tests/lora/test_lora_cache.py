"""The PEFT loader's scaling, the host LRU of adapters and the device slots."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LoRARequest
from pagedllm.lora.adapter import LoRAAdapter, ModelLoRASpec
from pagedllm.lora.host_cache import HostAdapterCache
from pagedllm.lora.peft_loader import load_peft_adapter
from pagedllm.lora.slots import LoRASlots
from pagedllm.models import load_model_config

SPEC = ModelLoRASpec(
    num_layers=2,
    shapes={
        p: (6, 10)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    },
)


def fake_adapter(lora_id: int, rank: int, modules=("q_proj",)) -> LoRAAdapter:
    weights = {
        (layer, m): (torch.full((rank, 6), float(lora_id)), torch.full((10, rank), 1.0))
        for layer in range(2)
        for m in modules
    }
    return LoRAAdapter(f"a{lora_id}", lora_id, "/nowhere", rank, 1.0, weights)


def test_loader_scales_as_peft_does(llama_world):
    spec = ModelLoRASpec.of(load_model_config(str(llama_world.base)))
    alpha = load_peft_adapter(llama_world.requests["alpha"], spec, 8, torch.float32)
    beta = load_peft_adapter(llama_world.requests["beta"], spec, 8, torch.float32)
    assert (alpha.rank, alpha.scaling) == (4, 8 / 4)
    assert beta.rank == 8 and beta.scaling == pytest.approx(16 / math.sqrt(8))  # rsLoRA
    assert alpha.target_modules == {"q_proj", "v_proj", "o_proj", "down_proj"}
    assert len(beta.weights) == 2 * 4  # every layer, each targeted projection


def test_host_cache_keeps_the_most_recent_adapters():
    loads = []

    def load(request):
        loads.append(request.lora_int_id)
        if request.lora_name == "bad":
            raise ValueError("bad folder")
        return fake_adapter(request.lora_int_id, 2)

    cache = HostAdapterCache(2, load)
    one, two, three = (LoRARequest(f"n{i}", i, "/p") for i in (1, 2, 3))
    cache.get(one), cache.get(two), cache.get(one)
    cache.get(three)  # evicts 2, the least recently used
    assert cache.ids() == [1, 3] and loads == [1, 2, 3]
    cache.get(two)
    assert loads == [1, 2, 3, 2] and cache.ids() == [3, 2]
    with pytest.raises(ValueError):
        cache.get(LoRARequest("bad", 9, "/p"))
    assert 9 not in cache and cache.ids() == [3, 2]


def test_slots_load_missing_adapters_into_slots_the_step_does_not_need():
    slots = LoRASlots(SPEC, max_loras=2, max_lora_rank=4, dtype=torch.float32, device="cpu")
    adapters = {
        i: fake_adapter(i, 2 + i % 2, ("q_proj", "v_proj") if i == 1 else ("up_proj",))
        for i in (1, 2, 3)
    }
    assert slots.assign([1, 2], adapters.__getitem__) == {1: 0, 2: 1}
    assert slots.num_loads == 2
    assert slots.assign([2], adapters.__getitem__) == {2: 1} and slots.num_loads == 2
    # 3 replaces 1 (least recently used), and nothing of 1 stays in slot 0
    assert slots.assign([2, 3], adapters.__getitem__) == {2: 1, 3: 0}
    a_qkv, b_q = slots.a["qkv_proj"], slots.b["q_proj"]
    assert not a_qkv[:, 0].any() and not b_q[:, 0].any()
    up_rows = slots.a["gate_up_proj"][:, 0, 4:8]  # up's rows follow gate's R=4
    assert torch.equal(up_rows[:, :3], torch.full((2, 3, 6), 3.0))
    assert not up_rows[:, 3:].any(), "rank 3 is zero-padded to 4"
    with pytest.raises(RuntimeError, match="more than max_loras=2"):
        slots.assign([1, 2, 3], adapters.__getitem__)
