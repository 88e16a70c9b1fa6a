"""Batched sampling on the logits' device (see `pagedllm.sampling.sampler`).

- `metadata`: `SamplingMetadata`, one step's per-row sampling inputs as tensors
- `ops`: logits processing (penalties, min-p, top-k, top-p)
- `logprobs`: logprobs of the raw model distribution
- `seeds`: per-sample seeds for seeded requests
- `sampler`: `Sampler`, which draws one token per row
- `verification`: the rows of a speculative verification step (shared by the model runner and
  `spec_decode`)

`SamplingParams`, the public per-request parameters, live in `pagedllm.sampling_params`.
"""

from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
