//! Drafts in the step's output: a general-path row's draft columns (`note_row`, called where
//! `schedule/plan.rs` records the row) and the step's seal (`seal_drafts`).
use crate::ids::{SeqId, TokenId};
use crate::scheduler::output::{StepOutput, TableRow};
use crate::scheduler::state::store::RequestStore;
use crate::scheduler::Scheduler;

use super::SpecState;

impl SpecState {
    /// Row `row` of `out` (just recorded by the general path: one token, `token`, then
    /// `count` drafts) computes the first `count` drafts of sequence `seq` of the request in
    /// slot `h`: its draft columns, in row order like the rows.
    pub(in crate::scheduler) fn note_row(
        &mut self,
        out: &mut StepOutput,
        row: u32,
        (h, seq): (u32, SeqId),
        token: TokenId,
        count: usize,
    ) {
        let (offset, _) = self.pending_run(h, seq);
        let r = &mut out.table_rows[row as usize];
        debug_assert_eq!(r.n as usize, count + 1, "a draft row computes one token");
        r.token = token;
        let ids = &mut out.extras;
        ids.spec_num_draft_tokens.resize(row as usize, 0);
        ids.spec_num_draft_tokens.push(count as i32);
        let run = &self.tokens[offset as usize..offset as usize + count];
        ids.spec_draft_token_ids
            .extend(run.iter().map(|&t| t as i64));
    }
}

impl Scheduler {
    /// Closes a step's drafts (after its rows are sealed): the draft column padded to every
    /// row, the step's token ids (built now, in one pass over the rows and the step's draft
    /// ids: a draft row's drafts are not in its sequence's history), the per-sample draft
    /// counts `update_from_output_runs` checks against; then the drafts are dropped.
    pub(in crate::scheduler) fn seal_drafts(&mut self, out: &mut StepOutput) {
        let spec = &mut self.spec;
        spec.sample_drafts.clear();
        spec.pending.clear();
        // The column is written only for rows with drafts (padded here to every row).
        if out.extras.spec_num_draft_tokens.is_empty() {
            return;
        }
        let row_drafts = &mut out.extras.spec_num_draft_tokens;
        row_drafts.resize(out.seq_ids.len(), 0);
        spec.sample_drafts.extend(
            out.sample_rows
                .iter()
                .map(|&r| row_drafts[r as usize] as u32),
        );
        let mut t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        let ids = draft_input_ids(&self.store, out, &t.rows);
        t.input_ids = Some(ids);
    }
}

/// [T] token ids of a step with drafts (its rows sealed into `rows`), in one pass: a draft
/// row's own token is inline, then its drafts from the step's draft ids; a decode row's token
/// is inline; a longer row's tokens come from its sequence's history.
fn draft_input_ids(store: &RequestStore, out: &StepOutput, rows: &[TableRow]) -> Vec<i64> {
    // Written in place (no per-row growth checks or copy calls: a row is a few tokens).
    let mut ids = vec![0i64; out.num_batched_tokens];
    let mut drafts = &out.extras.spec_draft_token_ids[..];
    let mut rest = &mut ids[..];
    for (row, &d) in rows.iter().zip(&out.extras.spec_num_draft_tokens) {
        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(row.n as usize);
        rest = tail;
        if d > 0 {
            let (run, more) = drafts.split_at(d as usize);
            drafts = more;
            dst[0] = row.token as i64;
            for (x, &t) in dst[1..].iter_mut().zip(run) {
                *x = t;
            }
        } else if row.n == 1 {
            dst[0] = row.token as i64;
        } else {
            let s = &store.get(row.handle).seqs[row.seq as usize];
            let start = row.start as usize;
            for (x, &t) in dst.iter_mut().zip(&s.tokens[start..]) {
                *x = t as i64;
            }
        }
    }
    ids
}
