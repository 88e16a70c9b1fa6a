"""Speculative decoding (vLLM's names): a proposer guesses the next tokens of a sequence, the
target model scores all of them in one forward, and verification keeps the longest prefix the
target agrees with plus one token of its own, so the output distribution is the target's.

- `config`: `SpeculativeConfig`, parsed and checked from `LLM(speculative_config={...})`
- `rejection_sampler`: `RejectionSampler`, verification (greedy and rejection sampling)
- `decoder`: `SpecDecoder`, the engine's hooks; `draft_model`: the draft-model proposer

The per-position rows a verification step scores are `pagedllm.sampling.verification` (below
the model runner, which needs them too).

The n-gram proposer runs in Rust over the scheduler's token histories
(`Scheduler.propose_drafts`, `rust/src/spec/ngram.rs`).
"""

from pagedllm.spec_decode.config import SPEC_METHODS, SpeculativeConfig
from pagedllm.spec_decode.rejection_sampler import RejectionSampler, VerifiedTokens

__all__ = ["SPEC_METHODS", "RejectionSampler", "SpeculativeConfig", "VerifiedTokens"]
