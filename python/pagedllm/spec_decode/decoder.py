"""`SpecDecoder`: the engine's side of speculative decoding, one call per hook of the step.

- construction: the scheduler's speculation knobs (`scheduler_kwargs`): the n-gram proposer's
  and, under the V0 strategies (`prefill_first`, `chunked_prefill`), `num_lookahead_slots = k`
  so each decode reserves its drafts' slots as V0 did; `unified` schedules them as V1 does;
- after the forward: `verify` scores each sample's drafts (`RejectionSampler`) from the logits
  of its `d + 1` positions (`verification_logits_rows`, picked by the model runner);
- after the update: `propose` gives the scheduler the next step's drafts: `ngram` asks it
  (`Scheduler.propose_drafts`, the proposer in Rust, one call); `draft_model` runs the draft
  (`DraftModelProposer`, attached by the engine with `attach_draft`) and hands them over
  (`Scheduler.set_drafts`, one call). A constrained sequence's drafts are first cut to the
  prefix its grammar accepts (`StructuredOutputManager.cut_drafts`). The draft also mirrors
  every step's block operations (`execute_block_ops`) and forward (`mirror`) on its own cache.

It also keeps vLLM's counters (`spec_decode_num_drafts`, `spec_decode_num_draft_tokens`,
`spec_decode_num_accepted_tokens`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial

import numpy as np
import torch

from pagedllm.sampling.grammar_mask import TokenBitmask, apply_token_bitmask
from pagedllm.sampling.verification import verification_rows
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.rejection_sampler import RejectionSampler, VerifiedTokens

logger = logging.getLogger("pagedllm")


class SpecDecoder:
    # what `get_stats()` reports with speculation off
    NO_STATS = {
        "spec_decode_num_drafts": 0,
        "spec_decode_num_draft_tokens": 0,
        "spec_decode_num_accepted_tokens": 0,
    }

    def __init__(self, config: SpeculativeConfig, generator: torch.Generator | None) -> None:
        self.config = config
        # draft_model: the draft and its cache (`attach_draft`), None for ngram
        self.draft = None
        self.rejection_sampler = RejectionSampler(generator)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def scheduler_kwargs(self, scheduling: str) -> dict:
        c = self.config
        kwargs = {
            "num_speculative_tokens": c.num_speculative_tokens,
            "prompt_lookup_max": c.prompt_lookup_max,
            "prompt_lookup_min": c.prompt_lookup_min,
        }
        if scheduling != "unified":
            kwargs["num_lookahead_slots"] = c.num_speculative_tokens
        return kwargs

    def verify(
        self,
        step,
        logits: torch.Tensor,
        requests: Mapping,
        rows: list[int] | None = None,
        grammar_mask: TokenBitmask | None = None,
    ) -> VerifiedTokens:
        """Verifies every sample of `step` (or only samples `rows`, to find a faulty request)
        from `logits`, the model runner's [sum(d + 1), V] rows in sample order.
        `grammar_mask` (structured output) masks the rows of `logits` scored under a grammar:
        every position of a constrained sample, so verification judges drafts against, and
        draws from, the grammar-masked target distribution."""
        d = step.spec_num_draft_tokens[step.sample_rows].astype(np.int64)
        drafts = step.spec_draft_token_ids
        draft_start = np.cumsum(d) - d
        request_ids = step.sample_request_ids
        seq_index = step.sample_seq_index.tolist()
        samples = range(len(d)) if rows is None else rows
        if rows is not None:
            logit_start = np.cumsum(d + 1) - (d + 1)
            picked = np.concatenate(
                [np.arange(logit_start[k], logit_start[k] + d[k] + 1) for k in rows]
            )
            logits = logits[torch.from_numpy(picked).to(logits.device)]
        runs = [drafts[draft_start[k] : draft_start[k] + d[k]].tolist() for k in samples]
        reqs = [requests[request_ids[k]] for k in samples]
        index = [seq_index[k] for k in samples]
        meta = verification_rows(
            [r.sampling_params for r in reqs],
            [r.seqs[i].token_ids for r, i in zip(reqs, index)],
            [r.prompt_token_ids for r in reqs],
            index,
            runs,
            vocab_size=logits.shape[-1],
            stop_token_ids=[r.stop.ids for r in reqs],
            device=logits.device,
        )
        d = d[list(samples)]
        if rows is None:
            flat = torch.from_numpy(drafts)
        else:
            flat = torch.tensor([t for run in runs for t in run], dtype=torch.int64)
        if grammar_mask is not None:
            logits = apply_token_bitmask(logits, grammar_mask)
        verified = self.rejection_sampler(logits, meta, d, flat.to(logits.device))
        if rows is None:
            self.num_drafts += int((d > 0).sum())
            self.num_draft_tokens += int(d.sum())
            self.num_accepted_tokens += int(verified.num_accepted.sum())
        return verified

    def attach_draft(self, draft) -> None:
        self.draft = draft

    def execute_block_ops(self, step) -> None:
        if self.draft is not None:
            self.draft.execute_block_ops(step)

    def mirror(self, inputs) -> None:
        if self.draft is not None:
            self.draft.mirror(inputs)

    def propose(self, scheduler, step=None, requests=None, grammar=None) -> None:
        """The next step's drafts, kept by the scheduler (one call per step; a second,
        `set_drafts`, when `grammar` (the structured-output manager) cuts a constrained
        sequence's drafts to what its grammar accepts). The draft model proposes for the
        sequences `step` sampled (`step` None: it ran no forward)."""
        cut = None
        if grammar is not None and grammar.live:
            cut = partial(grammar.cut_drafts, requests=requests)
        if self.draft is None:
            proposals = scheduler.propose_drafts()
            kept = cut(proposals) if cut is not None else None
            if kept is not None:
                scheduler.set_drafts(*kept)
        elif step is not None:
            try:
                self.draft.propose(step, requests, scheduler, cut)
            except Exception:
                # the step's tokens are already applied: a failed proposal costs only this
                # step's drafts (the next step decodes without them), never the step's outputs
                logger.exception("speculative decoding: the draft model's proposal failed")
                scheduler.set_drafts([], [], [])

    def stats(self) -> dict[str, int]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
