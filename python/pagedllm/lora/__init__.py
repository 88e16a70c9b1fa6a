"""Multi-LoRA serving: PEFT adapters from local folders, applied per request in mixed batches.

- `request.py` — `LoRARequest` (vLLM's name and fields);
- `peft_loader.py` — reading and checking a PEFT folder into a `LoRAAdapter` (`adapter.py`);
- `host_cache.py` — the host LRU of `max_cpu_loras` loaded adapters;
- `slots.py` — the `max_loras` device slots (stacked, rank-padded A/B buffers);
- `layers.py` — the LoRA-aware projections that add each step's deltas;
- `manager.py` — `LoRAManager`, the engine's entry point.

The scheduler (Rust, `scheduler/features/lora.rs`) keeps at most `max_loras` adapters per step and
salts prefix-cache keys with the adapter; the products are `kernels/lora.py` (Triton) and
`kernels/lora_reference.py` (torch, the CPU path).
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
