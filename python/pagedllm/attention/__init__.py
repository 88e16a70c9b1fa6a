"""Attention: the layer the models call, below them (it imports nothing of the models, the
worker or the engine).

- `paged`: the attention metadata of a step and the paged-attention entry point (Triton kernels
  on CUDA, the Rust kernels for float32 and bfloat16 on the CPU, the torch reference otherwise)
- `cpu_attention`: the CPU path through the Rust kernels (`pagedllm._core.cpu_*`)
- `kv_groups`: the KV cache's layer groups (full attention, sliding windows): each layer's block
  tables and its slot in a block
- `cpu_rotary`: rotary embedding in place on the CPU through Rust (`RopeTables`)

Nothing is imported here, so a model pulls in only what it uses.
"""
