//! Speculative decoding in the scheduler (vLLM V1's way, for every strategy): draft tokens
//! proposed after a step (`propose_drafts`, the n-gram proposer of `crate::spec::ngram` run
//! over the token histories the store already holds, one call per step) are scheduled with
//! their sequence's next token as extra query tokens, within the token budget, the chunk cap
//! and the model length (`spec_fast_run` for a single-sequence request whose run fits its table
//! or one fresh block, `plan.rs` otherwise); their KV slots are allocated like lookahead slots
//! but they are not counted as computed. `update_from_output_runs` then takes a run of 1 ..= d + 1
//! tokens per sample (the accepted drafts and the target's own token), appends them one by one
//! under the stop rules (a stop ends the run, the rest is dropped), counts the accepted drafts
//! as computed, registers blocks they filled in the prefix cache, and gives back blocks that
//! held only rejected drafts.
//!
//! Drafts live one step: `schedule()` consumes them (a request preempted or not scheduled by
//! that step simply loses its drafts), and a step without drafts is exactly the step the
//! scheduler takes without speculation.
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{SeqId, TokenId};
use crate::kv::block_table::blocks_for;
use crate::kv::IdBuildHasher;
use crate::spec::propose_ngram;

use super::output::{FinishedSeq, StepOutput};
use super::plan::sync_mirror;
use super::record::record;
use super::request::{Request, RequestStatus};
use super::step::check_token_ids;
use super::stop::{cut_run, FinishReason};
use super::update::{finish_seq, push_token};
use super::Scheduler;

/// The drafts of one `propose_drafts` call, as flat arrays: sequence `seq_ids[i]` got
/// `num_draft_tokens[i]` tokens, its run of `draft_token_ids` (runs in order).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftProposals {
    pub seq_ids: Vec<i64>,
    pub num_draft_tokens: Vec<i32>,
    pub draft_token_ids: Vec<i64>,
}

/// Drafts waiting for the next step, and what the latest step scheduled of them.
#[derive(Debug, Default)]
pub(super) struct SpecState {
    /// Sequence id -> (offset, count) of its drafts in `tokens` (ids hash as themselves).
    pending: HashMap<SeqId, (u32, u32), IdBuildHasher>,
    tokens: Vec<TokenId>,
    /// This step's draft rows, row order: (row, offset of its drafts in `tokens`, drafts
    /// scheduled).
    scheduled: Vec<(u32, u32, u32)>,
    /// Drafts scheduled for each sample of the latest step (empty: none at all).
    sample_drafts: Vec<u32>,
}

impl SpecState {
    /// Whether the next `schedule()` has drafts to place.
    #[inline]
    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Drafts waiting for sequence `seq` (0 when none).
    #[inline]
    pub(super) fn pending_count(&self, seq: SeqId) -> usize {
        if self.pending.is_empty() {
            return 0;
        }
        self.pending.get(&seq).map_or(0, |&(_, n)| n as usize)
    }

    /// (offset, count) of the drafts waiting for sequence `seq` ((0, 0) when none).
    #[inline]
    fn pending_run(&self, seq: SeqId) -> (u32, u32) {
        if self.pending.is_empty() {
            return (0, 0);
        }
        self.pending.get(&seq).copied().unwrap_or((0, 0))
    }

    /// Row `row` of this step computes the first `count` drafts of sequence `seq`.
    pub(super) fn note_row(&mut self, row: u32, seq: SeqId, count: usize) {
        let (offset, _) = self.pending[&seq];
        self.scheduled.push((row, offset, count as u32));
    }

    /// `count` drafts from `offset` in `tokens`.
    fn drafts(&self, offset: u32, count: u32) -> &[TokenId] {
        &self.tokens[offset as usize..(offset + count) as usize]
    }
}

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
        let mut out = DraftProposals::default();
        let spec = &mut self.spec;
        spec.pending.clear();
        spec.tokens.clear();
        for &h in &self.queues.running {
            let req = self.store.get(h);
            if req.needs_fork() {
                continue;
            }
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
                spec.pending.insert(s.id, (offset as u32, n as u32));
                out.seq_ids.push(s.id as i64);
                out.num_draft_tokens.push(n as i32);
                out.draft_token_ids
                    .extend(spec.tokens[offset..].iter().map(|&t| t as i64));
            }
        }
        out
    }

    /// The fast path of a step with drafts, over `running[i..]` within `left` tokens: a
    /// single-sequence request decoding into blocks it owns alone, whose run (its token, then
    /// its drafts, trimmed to the budget and the model length) fits its table or one fresh
    /// block, is recorded, registered and sampled here without the general planner. Stops at
    /// the first request it does not take (the general path plans that one). Returns (requests
    /// taken, tokens used). Off with lookahead slots (the V0 strategies' drafts ride in them:
    /// the general path).
    pub(super) fn spec_fast_run(
        &mut self,
        i: usize,
        mut left: usize,
        out: &mut StepOutput,
    ) -> Result<(usize, usize)> {
        if self.cfg.num_lookahead_slots != 0 {
            return Ok((0, 0));
        }
        let (bs, max_model_len, caching) = (
            self.mgr.block_size(),
            self.cfg.max_model_len,
            self.caching(),
        );
        let budget = left;
        let mut k = 0;
        while let Some(&h) = self.queues.running.get(i + k) {
            let gen = self.store.gen(h);
            let req = self.store.get_mut(h);
            let extra_key = req.extra_key;
            let [s] = &mut req.seqs[..] else {
                break;
            };
            let start = s.num_computed;
            if left == 0 || s.tail_shared || s.tokens.len() != start + 1 || start >= max_model_len {
                break;
            }
            let (offset, pending) = self.spec.pending_run(s.id);
            let d = (pending as usize)
                .min(left - 1)
                .min(max_model_len - start - 1);
            let have = s.table.num_blocks();
            let need = blocks_for(start + 1 + d, bs);
            if need > have {
                // One fresh block past a table that covers `start`: nothing shared is written.
                if need > have + 1 || start > have * bs || self.mgr.num_free_device_blocks() == 0 {
                    break;
                }
                let Some(block) = self.mgr.append_fresh_block(s.id)? else {
                    break;
                };
                s.table.push(block);
            }
            let row = out.seq_ids.len();
            record(out, h, gen, 0, s, start, 1 + d, bs);
            s.num_computed = start + 1;
            if caching && (start + 1) % bs == 0 {
                self.mgr
                    .cache_full_blocks(s.id, &s.tokens, start + 1, extra_key)?;
            }
            out.push_sample(row, s.id, h, gen, 0);
            if d > 0 {
                self.spec.scheduled.push((row as u32, offset, d as u32));
            }
            left -= 1 + d;
            k += 1;
        }
        Ok((k, budget - left))
    }

    /// Closes a step's drafts (after its rows are sealed): the per-row draft columns, the
    /// step's token ids (built now, while the drafts exist: a draft row's tokens are not all
    /// in its sequence's history), the per-sample draft counts `update_from_output_runs`
    /// checks against; then the drafts are dropped.
    pub(super) fn seal_drafts(&mut self, out: &mut StepOutput) {
        self.spec.sample_drafts.clear();
        if self.spec.scheduled.is_empty() {
            self.spec.pending.clear();
            return;
        }
        // the output's and the ledger's buffers keep their capacity across steps
        let mut row_drafts = std::mem::take(&mut out.extras.spec_num_draft_tokens);
        row_drafts.clear();
        row_drafts.resize(out.num_seqs(), 0);
        let spec = &mut self.spec;
        for &(row, offset, n) in &spec.scheduled {
            row_drafts[row as usize] = n as i32;
            let run = &spec.tokens[offset as usize..(offset + n) as usize];
            out.extras
                .spec_draft_token_ids
                .extend(run.iter().map(|&t| t as i64));
        }
        spec.sample_drafts.extend(
            out.sample_rows
                .iter()
                .map(|&r| row_drafts[r as usize] as u32),
        );
        let ids = self.draft_input_ids(out, &row_drafts);
        out.tables
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .input_ids = Some(ids);
        out.extras.spec_num_draft_tokens = row_drafts;
        self.spec.scheduled.clear();
        self.spec.pending.clear();
    }

    /// [T] token ids of a step with drafts: each row's own tokens from its sequence, then its
    /// drafts.
    fn draft_input_ids(&self, out: &StepOutput, row_drafts: &[i32]) -> Vec<i64> {
        let t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        let mut ids = Vec::with_capacity(out.num_batched_tokens);
        let mut drafts = self.spec.scheduled.iter();
        for (r, row) in t.rows.iter().enumerate() {
            let d = row_drafts[r] as usize;
            let own = row.n as usize - d;
            let s = &self.store.get(row.handle).seqs[row.seq as usize];
            let start = row.start as usize;
            ids.extend(s.tokens[start..start + own].iter().map(|&t| t as i64));
            if d > 0 {
                let &(_, offset, n) = drafts.next().expect("a draft row was noted");
                ids.extend(self.spec.drafts(offset, n).iter().map(|&t| t as i64));
            }
        }
        ids
    }

    /// `update_from_output` for a step whose samples each bring a run of tokens (speculative
    /// decoding): sample `k` of the latest step brings `num_tokens[k]` tokens, consecutive in
    /// `sampled` — its accepted drafts then the target's own token, so 1 ..= drafts + 1 of
    /// them. Each token is appended under the stop rules; a stop ends the run (tokens after
    /// it are dropped). `stop_hit[k]` finishes the sequence as stopped at the run's last token
    /// (a stop string matched there; the caller cuts the run at the match). Accepted drafts
    /// become computed, blocks they filled are registered in the prefix cache, and blocks
    /// that held only rejected drafts are given back.
    pub fn update_from_output_runs(
        &mut self,
        step: u64,
        sampled: &[i64],
        num_tokens: &[i64],
        stop_hit: Option<&[bool]>,
    ) -> Result<Vec<FinishedSeq>> {
        self.check_runs(sampled, num_tokens)?;
        // The ledger checks the step, the sample count and each run's first token; the
        // runs' other tokens were checked above.
        let firsts: Vec<i64> = run_starts(num_tokens)
            .map(|(start, _)| sampled[start])
            .collect();
        self.ledger.close_for_update(step, &firsts, stop_hit)?;
        self.spec.sample_drafts.clear();
        // Held outputs describe tables this update may shorten: snapshot them first.
        self.recorder.materialize_pending(&self.store);
        let max_len = self.cfg.max_seq_len();
        let la = self.cfg.num_lookahead_slots;
        let caching = self.caching();
        let mut finished = Vec::new();
        self.ledger.finished.clear();
        let mut any_request_done = false;
        for (k, (start, count)) in run_starts(num_tokens).enumerate() {
            let (h, gen, idx) = (
                self.ledger.handles[k],
                self.ledger.gens[k],
                self.ledger.seq_index[k] as usize,
            );
            if !self.store.is_live(h, gen) {
                continue;
            }
            let req = self.store.get_mut(h);
            if req.status != RequestStatus::Running
                || req.seqs.get(idx).is_none_or(|s| s.is_finished())
            {
                continue;
            }
            let hit = stop_hit.is_some_and(|s| s[k]);
            let run = &sampled[start..start + count];
            if let Some(fin) = append_run(req, idx, run, hit, max_len) {
                any_request_done |= finish_seq(
                    req,
                    h,
                    idx as u32,
                    fin,
                    &mut self.mgr,
                    &mut self.queues,
                    &mut self.ledger.finished,
                    &mut finished,
                )?;
                continue;
            }
            // The run's first token was the one the row computed; the rest were drafts.
            let s = &mut req.seqs[idx];
            let before = s.num_computed;
            s.num_computed += count - 1;
            let (id, computed, extra_key) = (s.id, s.num_computed, req.extra_key);
            let bs = self.mgr.block_size();
            if caching && computed / bs > before / bs {
                let s = &self.store.get(h).seqs[idx];
                self.mgr
                    .cache_full_blocks(id, &s.tokens, computed, extra_key)?;
            }
            if self.mgr.truncate_slots(id, computed + la)? > 0 {
                sync_mirror(&self.mgr, &mut self.store.get_mut(h).seqs[idx])?;
            }
        }
        self.settle_finished(any_request_done)?;
        Ok(finished)
    }

    /// Checks the runs of an `update_from_output_runs` call against the latest step's drafts
    /// (nothing changes on an error).
    pub(super) fn check_runs(&self, sampled: &[i64], num_tokens: &[i64]) -> Result<()> {
        let k = self.ledger.handles.len();
        if num_tokens.len() != k {
            return Err(Error::InvalidArgument(format!(
                "num_tokens has {} entries, step {} has {k} samples",
                num_tokens.len(),
                self.ledger.step
            )));
        }
        let drafts = &self.spec.sample_drafts;
        for (i, &n) in num_tokens.iter().enumerate() {
            let most = 1 + drafts.get(i).copied().unwrap_or(0) as i64;
            if !(1..=most).contains(&n) {
                return Err(Error::InvalidArgument(format!(
                    "num_tokens[{i}] = {n}: sample {i} brings 1 ..= {most} tokens (its drafts \
                     plus one)"
                )));
            }
        }
        let total: i64 = num_tokens.iter().sum();
        if sampled.len() as i64 != total {
            return Err(Error::InvalidArgument(format!(
                "sampled_token_ids has {} entries, num_tokens adds up to {total}",
                sampled.len()
            )));
        }
        check_token_ids(sampled)
    }
}

/// (start, count) of each run in the flat token array.
fn run_starts(num_tokens: &[i64]) -> impl Iterator<Item = (usize, usize)> + '_ {
    num_tokens.iter().scan(0usize, |at, &n| {
        let start = *at;
        *at += n as usize;
        Some((start, n as usize))
    })
}

/// Appends `run` to sequence `idx` of `req` up to the token the stop rules end it at
/// (`stop::cut_run`; `hit`: a stop string ends the run at its last token); returns that
/// token's finish, `None` when the whole run is in.
fn append_run(
    req: &mut Request,
    idx: usize,
    run: &[i64],
    hit: bool,
    max_len: usize,
) -> Option<(FinishReason, Option<TokenId>)> {
    let s = &mut req.seqs[idx];
    let (kept, fin) = cut_run(&req.stop, req.prompt_len, s.tokens.len(), run, hit, max_len);
    for &t in &run[..kept] {
        push_token(s, t as TokenId);
    }
    fin
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
