//! Speculative decoding in the scheduler (vLLM V1's way, for every strategy): draft tokens
//! proposed after a step (`propose_drafts`, the n-gram proposer of `crate::spec::ngram` run
//! over the token histories the store already holds, one call per step) are scheduled with
//! their sequence's next token as extra query tokens, within the token budget, the chunk cap
//! and the model length (`spec_fast_run` for a single-sequence request whose run fits its table
//! or one fresh block, `schedule/plan.rs` otherwise); their KV slots are allocated like
//! lookahead slots but they are not counted as computed. `update_from_output_runs`
//! (`apply/spec_update.rs`) then takes a run of 1 ..= d + 1 tokens per sample (the accepted
//! drafts and the target's own token), appends them under the stop rules (a stop ends the run,
//! the rest is dropped), counts the accepted drafts as computed, registers blocks they filled
//! in the prefix cache, and gives back blocks that held only rejected drafts.
//!
//! Drafts live one step: `schedule()` consumes them (a request preempted or not scheduled by
//! that step simply loses its drafts), and a step without drafts is exactly the step the
//! scheduler takes without speculation.
//!
//! - `propose.rs` — the drafts of the next step: `propose_drafts` (n-gram), `set_drafts`
//!   (drafts from outside), trimmed to each sequence's room;
//! - `fast_path.rs` — the draft fast path of the walk over `running` (`spec_fast_run`), its
//!   rows queued and recorded in batches;
//! - `record.rs` — a general-path row's draft columns (`note_row`) and the step's seal
//!   (`seal_drafts`: the columns padded, the step's token ids, the per-sample draft counts).
//!
//! Applying a verification step's runs is `apply/spec_update.rs`.
mod fast_path;
mod propose;
mod record;

use crate::ids::{SeqId, TokenId};

pub(in crate::scheduler) use fast_path::spec_fast_run;

use fast_path::SpecRow;

/// The drafts of one `propose_drafts` call, as flat arrays: sequence `seq_ids[i]` got
/// `num_draft_tokens[i]` tokens, its run of `draft_token_ids` (runs in order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftProposals {
    pub seq_ids: Vec<i64>,
    pub num_draft_tokens: Vec<i32>,
    pub draft_token_ids: Vec<i64>,
}

/// The drafts proposed for one sequence: its `count` tokens from `offset` in `SpecState::tokens`.
#[derive(Debug, Clone, Copy)]
struct PendingRun {
    handle: u32,
    seq: SeqId,
    offset: u32,
    count: u32,
}

/// Drafts waiting for the next step, and what the step being built scheduled of them.
#[derive(Debug, Default)]
pub(in crate::scheduler) struct SpecState {
    /// The runs of the latest proposal, in proposal order (a request's sequences are
    /// consecutive).
    pending: Vec<PendingRun>,
    /// Request slot -> index in `pending` of the request's first run. Never cleared: an entry
    /// left from an older proposal names a run of another sequence (sequence ids are never
    /// reused), which the lookup tells apart.
    by_slot: Vec<u32>,
    tokens: Vec<TokenId>,
    /// Fast-path rows not yet in the output, their drafts in all, and those drafts as
    /// stretches of `tokens` (from, to): rows taking their whole proposal in proposal order
    /// have adjacent runs, copied at once.
    rows: Vec<SpecRow>,
    queued_drafts: usize,
    stretches: Vec<(u32, u32)>,
    /// Where the fast path expects the next run in `pending` (the walk follows `running`,
    /// as the proposal did).
    cursor: usize,
    /// Drafts scheduled for each sample of the latest step (empty: none at all).
    pub(in crate::scheduler) sample_drafts: Vec<u32>,
}

impl SpecState {
    /// Whether the next `schedule()` has drafts to place.
    #[inline]
    pub(in crate::scheduler) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// (offset, count) of the drafts waiting for sequence `seq` of the request in slot `h`
    /// ((0, 0) when none): a flat index by slot, then the request's runs.
    #[inline]
    fn pending_run(&self, h: u32, seq: SeqId) -> (u32, u32) {
        let Some(&first) = self.by_slot.get(h as usize) else {
            return (0, 0);
        };
        for run in self.pending.get(first as usize..).unwrap_or_default() {
            if run.seq == seq {
                return (run.offset, run.count);
            }
            if run.handle != h {
                break;
            }
        }
        (0, 0)
    }

    /// `pending_run` for a single-sequence request (its only run is the request's first):
    /// the run after the last one found, else the slot's.
    #[inline(always)]
    fn single_run(&mut self, h: u32, seq: SeqId) -> (u32, u32) {
        let at = match self.pending.get(self.cursor) {
            Some(run) if run.seq == seq => self.cursor,
            _ => self.by_slot.get(h as usize).copied().unwrap_or(u32::MAX) as usize,
        };
        match self.pending.get(at) {
            Some(run) if run.seq == seq => {
                self.cursor = at + 1;
                (run.offset, run.count)
            }
            _ => (0, 0),
        }
    }

    /// Drafts waiting for sequence `seq` of the request in slot `h` (0 when none).
    #[inline]
    pub(in crate::scheduler) fn pending_count(&self, h: u32, seq: SeqId) -> usize {
        self.pending_run(h, seq).1 as usize
    }
}
