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

Names are resolved lazily: `pagedllm.config` needs `config` (pure Python), and importing the
package for it must not import torch (the CLI's `--help` would take seconds).
"""

from __future__ import annotations

from pagedllm._lazy import lazy_names

# public name -> submodule defining it
_LAZY = {
    "SPEC_METHODS": "config",
    "SpeculativeConfig": "config",
    "RejectionSampler": "rejection_sampler",
    "VerifiedTokens": "rejection_sampler",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_names(__name__, _LAZY)
