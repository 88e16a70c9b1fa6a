"""The worker: what runs a scheduled step on the device.

- `worker`: `Worker`, one rank (its shard, LoRA slots, KV cache, runner), whichever process holds
  it; the step a rank receives (`StepMessage`, `StepArrays`: the fields Rust marks as inputs)
- `model_runner`: step arrays -> device tensors -> forward -> logits of the rows to sample
- `cache_engine`: the paged KV cache, its host swap space and the block operations
- `cpu_threads`: the CPU thread default

It sits above the models (it runs them) and below the engine; the attention the models call is
the layer below the models (`pagedllm.attention`). Nothing is imported here.
"""
