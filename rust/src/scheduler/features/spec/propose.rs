//! The drafts of the next step: proposed by the n-gram proposer over the token histories
//! (`propose_drafts`) or handed in from outside (`set_drafts`: a draft model, or n-gram drafts
//! cut to what a grammar accepts), kept for one `schedule()`.
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{SeqId, TokenId};
use crate::kv::IdBuildHasher;
use crate::scheduler::state::request::Request;
use crate::scheduler::Scheduler;
use crate::spec::propose_ngram;

use super::{DraftProposals, PendingRun};

impl Scheduler {
    /// Proposes draft tokens with the configured n-gram proposer for every unfinished
    /// sequence of `running` that decodes one token next step (its prompt computed), walking
    /// `running` in order, and keeps them for the next `schedule()` (replacing any not yet
    /// scheduled). A sequence gets at most `num_speculative_tokens`, fewer when the model
    /// length or its `max_tokens` leaves less room (a run of drafts plus one token then ends
    /// at most at the limit, never past it), none when no suffix of its history recurs.
    /// Sequences without drafts are not listed.
    pub fn propose_drafts(&mut self) -> Result<DraftProposals> {
        let cfg = self.speculative_config()?;
        Ok(self.collect_drafts(|tokens, _, k, out| propose_ngram(tokens, &cfg, k, out)))
    }

    /// Keeps drafts proposed outside the scheduler (a draft model run by the engine, or n-gram
    /// drafts the engine cut to what a grammar accepts) for the next `schedule()`, replacing
    /// any not yet scheduled: sequence `seq_ids[i]` proposes `num_draft_tokens[i]` tokens, its
    /// run of `draft_token_ids` (runs in order). Only the sequences `propose_drafts` would
    /// serve keep theirs, trimmed to the same room (at most `num_speculative_tokens`); others
    /// (finished, forking, not decoding next) are dropped. Returns the drafts kept.
    pub fn set_drafts(
        &mut self,
        seq_ids: &[i64],
        num_draft_tokens: &[i64],
        draft_token_ids: &[i64],
    ) -> Result<DraftProposals> {
        self.speculative_config()?;
        let runs = draft_runs(seq_ids, num_draft_tokens, draft_token_ids)?;
        Ok(self.collect_drafts(|_, seq, k, out| {
            let Some(&(offset, count)) = runs.get(&seq) else {
                return 0;
            };
            let n = count.min(k);
            let run = &draft_token_ids[offset..offset + n];
            out.extend(run.iter().map(|&t| t as TokenId));
            n
        }))
    }

    fn speculative_config(&self) -> Result<crate::spec::NgramConfig> {
        self.cfg.speculative.ok_or_else(|| {
            Error::InvalidState("speculative decoding is off (no num_speculative_tokens)".into())
        })
    }

    /// Drafts from `propose(tokens, seq, k, out)` (appends at most `k`, returns how many) for
    /// every unfinished sequence of `running` that decodes one token next step, kept for the
    /// next `schedule()`. A forking request gets none; a constrained one gets them like any
    /// other, and the engine cuts them to the prefix its grammar accepts (`set_drafts`) before
    /// the step; `k` is trimmed to the sequence's room (`draft_room`).
    fn collect_drafts(
        &mut self,
        mut propose: impl FnMut(&[TokenId], SeqId, usize, &mut Vec<TokenId>) -> usize,
    ) -> DraftProposals {
        let max_len = self.cfg.max_seq_len();
        let max_k = self.cfg.speculative.map_or(0, |c| c.num_speculative_tokens);
        let running = &self.queues.running;
        let mut out = DraftProposals {
            seq_ids: Vec::with_capacity(running.len()),
            num_draft_tokens: Vec::with_capacity(running.len()),
            draft_token_ids: Vec::with_capacity(running.len() * max_k),
        };
        let spec = &mut self.spec;
        spec.pending.clear();
        spec.tokens.clear();
        spec.cursor = 0;
        for &h in running {
            let req = self.store.get(h);
            if req.needs_fork() {
                continue;
            }
            let first = spec.pending.len();
            for i in req.active_seqs() {
                let s = &req.seqs[i];
                if s.tokens.len() != s.num_computed + 1 {
                    continue;
                }
                let room = draft_room(req, s.tokens.len(), max_len);
                let k = max_k.min(room);
                let offset = spec.tokens.len();
                let n = if k == 0 {
                    0
                } else {
                    propose(&s.tokens, s.id, k, &mut spec.tokens)
                };
                if n == 0 {
                    continue;
                }
                spec.pending.push(PendingRun {
                    handle: h,
                    seq: s.id,
                    offset: offset as u32,
                    count: n as u32,
                });
                out.seq_ids.push(s.id as i64);
                out.num_draft_tokens.push(n as i32);
                out.draft_token_ids
                    .extend(spec.tokens[offset..].iter().map(|&t| t as i64));
            }
            if spec.pending.len() > first {
                if spec.by_slot.len() <= h as usize {
                    spec.by_slot.resize(h as usize + 1, u32::MAX);
                }
                spec.by_slot[h as usize] = first as u32;
            }
        }
        out
    }
}

/// Sequence id -> (offset, count) of its run in `draft_token_ids`, the arrays checked.
fn draft_runs(
    seq_ids: &[i64],
    num_draft_tokens: &[i64],
    draft_token_ids: &[i64],
) -> Result<HashMap<SeqId, (usize, usize), IdBuildHasher>> {
    if seq_ids.len() != num_draft_tokens.len() {
        return Err(Error::InvalidArgument(format!(
            "set_drafts: {} seq_ids but {} num_draft_tokens",
            seq_ids.len(),
            num_draft_tokens.len()
        )));
    }
    if let Some(&t) = draft_token_ids
        .iter()
        .find(|&&t| t < 0 || t > TokenId::MAX as i64)
    {
        return Err(Error::InvalidArgument(format!(
            "set_drafts: draft token id {t} is out of range"
        )));
    }
    let mut runs = HashMap::with_capacity_and_hasher(seq_ids.len(), IdBuildHasher::default());
    let mut offset = 0usize;
    for (&seq, &count) in seq_ids.iter().zip(num_draft_tokens) {
        if seq < 0 || count < 0 {
            return Err(Error::InvalidArgument(format!(
                "set_drafts: seq id {seq} with {count} drafts (both must be >= 0)"
            )));
        }
        runs.insert(seq as SeqId, (offset, count as usize));
        offset += count as usize;
    }
    if offset != draft_token_ids.len() {
        return Err(Error::InvalidArgument(format!(
            "set_drafts: num_draft_tokens sum to {offset}, {} draft_token_ids given",
            draft_token_ids.len()
        )));
    }
    Ok(runs)
}

/// Drafts a sequence of `len` tokens of `req` may usefully take: a step with `d` drafts yields
/// up to `d + 1` tokens, which `max_tokens` and the model length must both leave room for, so
/// a length limit can only end a run at its last token.
fn draft_room(req: &Request, len: usize, max_len: usize) -> usize {
    let generated = len - req.prompt_len;
    let by_tokens = req.stop.max_tokens.saturating_sub(generated + 1);
    let by_len = max_len.saturating_sub(len + 1);
    by_tokens.min(by_len)
}
