"""The worker: what runs a scheduled step on the device.

- `model_runner`: step arrays -> device tensors -> forward -> logits of the rows to sample
- `cache_engine`: the paged KV cache, its host swap space and the block operations
- `attention`: the attention metadata of a step and the paged-attention entry point the models
  call (Triton kernels on CUDA, the torch reference elsewhere)

Nothing is imported here, so `pagedllm.worker.attention` (imported by the models) does not pull
in the runner.
"""
