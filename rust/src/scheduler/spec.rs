//! Speculative decoding in the scheduler (vLLM V1's way, for every strategy): draft tokens
//! proposed after a step (`propose_drafts`, the n-gram proposer of `crate::spec::ngram` run
//! over the token histories the store already holds, one call per step) are scheduled with
//! their sequence's next token as extra query tokens, within the token budget, the chunk cap
//! and the model length (`spec_fast_run` for a single-sequence request whose run fits its table
//! or one fresh block, `plan.rs` otherwise); their KV slots are allocated like lookahead slots
//! but they are not counted as computed. `update_from_output_runs` (`spec_update.rs`) then
//! takes a run of 1 ..= d + 1 tokens per sample (the accepted drafts and the target's own
//! token), appends them under the stop rules (a stop ends the run, the rest is dropped), counts
//! the accepted drafts as computed, registers blocks they filled in the prefix cache, and gives
//! back blocks that held only rejected drafts.
//!
//! Drafts live one step: `schedule()` consumes them (a request preempted or not scheduled by
//! that step simply loses its drafts), and a step without drafts is exactly the step the
//! scheduler takes without speculation.
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{SeqId, TokenId};
use crate::kv::{IdBuildHasher, KvCacheManager};
use crate::spec::propose_ngram;

use super::output::{StepOutput, TableRow};
use super::schedule::decode::{record_rows, DecodeBatch, DecodeRow};
use super::state::request::Request;
use super::state::store::{RequestStore, Slot};
use super::Scheduler;

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

/// A fast-path row of a step with drafts, as `SpecState::flush_rows` records it: its table
/// row in the output's layout (its own token inline), and how many drafts follow it (their
/// tokens are queued as stretches, `SpecState::stretches`).
#[derive(Debug, Clone, Copy)]
struct SpecRow {
    decode: DecodeRow,
    drafts: u32,
}

/// Fast-path rows queued before `flush_rows` records them (the rows stay in L1 between the
/// flush's passes).
const SPEC_BATCH: usize = 64;

/// Drafts waiting for the next step, and what the step being built scheduled of them.
#[derive(Debug, Default)]
pub(super) struct SpecState {
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
    pub(super) sample_drafts: Vec<u32>,
}

impl SpecState {
    /// Whether the next `schedule()` has drafts to place.
    #[inline]
    pub(super) fn has_pending(&self) -> bool {
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

    /// Queues the `count` drafts from `offset` of a fast-path row.
    #[inline(always)]
    fn queue_drafts(&mut self, offset: u32, count: u32) {
        self.queued_drafts += count as usize;
        match self.stretches.last_mut() {
            Some(last) if last.1 == offset => last.1 += count,
            _ => self.stretches.push((offset, offset + count)),
        }
    }

    /// Drafts waiting for sequence `seq` of the request in slot `h` (0 when none).
    #[inline]
    pub(super) fn pending_count(&self, h: u32, seq: SeqId) -> usize {
        self.pending_run(h, seq).1 as usize
    }

    /// Row `row` of `out` (just recorded by the general path: one token, `token`, then
    /// `count` drafts) computes the first `count` drafts of sequence `seq` of the request in
    /// slot `h`: its draft columns, in row order like the rows.
    pub(super) fn note_row(
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

    /// Records the queued fast-path rows (rows, samples, draft columns; queue order) into
    /// `out`: one tight loop per output array.
    fn flush_rows(&mut self, out: &mut StepOutput) {
        let rows = &self.rows;
        if rows.is_empty() {
            return;
        }
        let base = out.seq_ids.len();
        record_rows(out, rows.iter().map(|r| &r.decode));
        out.num_batched_tokens += self.queued_drafts;
        if self.queued_drafts > 0 {
            let col = &mut out.extras.spec_num_draft_tokens;
            col.resize(base, 0);
            col.extend(rows.iter().map(|r| r.drafts as i32));
            let ids = &mut out.extras.spec_draft_token_ids;
            for &(from, to) in &self.stretches {
                ids.extend(
                    self.tokens[from as usize..to as usize]
                        .iter()
                        .map(|&t| t as i64),
                );
            }
            self.stretches.clear();
            self.queued_drafts = 0;
        }
        self.rows.clear();
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

    /// The fast path of a step with drafts, over `running[i..]` within `left` tokens: a
    /// single-sequence request decoding into blocks it owns alone, whose run (its token, then
    /// its drafts, trimmed to the budget and the model length) fits its table or one fresh
    /// block, is queued, recorded in batches and registered in batches (the block fills with
    /// the plain decode fast path's, `decode.rs`) without the general planner. Stops at the first request it does
    /// not take (the general path plans that one); its rows are in `out` when it returns.
    /// Returns (requests taken, tokens used). Off with lookahead slots (the V0 strategies'
    /// drafts ride in them: the general path).
    pub(super) fn spec_fast_run(
        &mut self,
        i: usize,
        left: usize,
        out: &mut StepOutput,
    ) -> Result<(usize, usize)> {
        if self.cfg.num_lookahead_slots != 0 {
            return Ok((0, 0));
        }
        let facts = SpecFacts {
            block_size: self.mgr.block_size(),
            max_model_len: self.cfg.max_model_len,
            caching: self.caching(),
        };
        let Scheduler {
            queues,
            store,
            mgr,
            batch,
            spec,
            ..
        } = self;
        let taken = spec_fast_run(
            &queues.running[i..],
            left,
            facts,
            store,
            mgr,
            batch,
            spec,
            out,
        );
        spec.flush_rows(out);
        taken
    }

    /// Closes a step's drafts (after its rows are sealed): the draft column padded to every
    /// row, the step's token ids (built now, in one pass over the rows and the step's draft
    /// ids: a draft row's drafts are not in its sequence's history), the per-sample draft
    /// counts `update_from_output_runs` checks against; then the drafts are dropped.
    pub(super) fn seal_drafts(&mut self, out: &mut StepOutput) {
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

/// What the draft fast path reads per step (kept in registers).
#[derive(Debug, Clone, Copy)]
struct SpecFacts {
    block_size: usize,
    max_model_len: usize,
    caching: bool,
}

/// One request's turn in the draft fast path.
enum SpecTurn {
    /// Queued: the tokens it takes.
    Taken(usize),
    /// Not for the fast path: the walk stops here.
    Refused,
    /// Its fresh block would evict a cached one while registrations are queued: they go
    /// first (as they would have unbatched), then it is tried again.
    FlushFirst,
}

/// See `Scheduler::spec_fast_run` (a free function: its borrows are disjoint parameters).
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn spec_fast_run(
    running: &[u32],
    mut left: usize,
    facts: SpecFacts,
    store: &mut RequestStore,
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    spec: &mut SpecState,
    out: &mut StepOutput,
) -> Result<(usize, usize)> {
    let budget = left;
    let mut k = 0;
    while let Some(&h) = running.get(k) {
        if left == 0 {
            break;
        }
        match spec_turn(h, left, facts, store.slots_mut(), mgr, batch, spec)? {
            SpecTurn::Taken(used) => {
                left -= used;
                k += 1;
                if spec.rows.len() >= SPEC_BATCH {
                    spec.flush_rows(out);
                }
            }
            SpecTurn::Refused => break,
            SpecTurn::FlushFirst => batch.flush(store, mgr)?,
        }
    }
    Ok((k, budget - left))
}

/// Queues request `h`'s row (its token and up to `left - 1` of its drafts) if the fast path
/// takes it (see `Scheduler::spec_fast_run`); nothing changes otherwise.
#[inline(always)]
fn spec_turn(
    h: u32,
    left: usize,
    facts: SpecFacts,
    slots: &mut [Slot],
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    spec: &mut SpecState,
) -> Result<SpecTurn> {
    let bs = facts.block_size;
    let slot = &mut slots[h as usize];
    let gen = slot.gen;
    let req = slot.req.as_mut().expect("queued slot holds a request");
    let Some(s) = req.seqs.single_mut() else {
        return Ok(SpecTurn::Refused);
    };
    let start = s.num_computed;
    if s.tail_shared || s.tokens.len() != start + 1 || start >= facts.max_model_len {
        return Ok(SpecTurn::Refused);
    }
    let (offset, pending) = spec.single_run(h, s.id);
    let d = (pending as usize)
        .min(left - 1)
        .min(facts.max_model_len - start - 1);
    // Capacities, not block counts: no division on this path (as `decode.rs`).
    let cap = s.table.num_blocks() * bs;
    let end = start + 1 + d;
    if end > cap {
        // One fresh block past a table that covers `start`: nothing shared is written.
        if end > cap + bs || start > cap || mgr.num_free_device_blocks() == 0 {
            return Ok(SpecTurn::Refused);
        }
        if batch.has_fills() && mgr.num_uncached_free_device_blocks() == 0 {
            return Ok(SpecTurn::FlushFirst);
        }
        let Some(block) = mgr.append_fresh_block(s.id)? else {
            return Ok(SpecTurn::Refused);
        };
        s.table.push(block);
    }
    // `start` fills its block when it is the last slot of the table before any fresh block
    // (the common cases; any other position is told by a division).
    let fills = if start < cap && start + bs >= cap {
        start + 1 == cap
    } else {
        (start + 1) % bs == 0
    };
    // A row without drafts is a plain decode row: its KV slot inline too (`start` is in
    // the last block, unless lookahead-free tables ever run longer).
    let slot = if d > 0 {
        0
    } else {
        let tail_start = (s.table.num_blocks() - 1) * bs;
        if start >= tail_start {
            (s.table.last_block() as usize * bs + start - tail_start) as i64
        } else {
            (s.table[start / bs] as usize * bs + start % bs) as i64
        }
    };
    spec.rows.push(SpecRow {
        decode: DecodeRow {
            row: TableRow {
                handle: h,
                seq: 0,
                len: s.table.num_blocks() as u32,
                start: start as u32,
                n: 1 + d as u32,
                // tokens.len() == start + 1 was checked above, so this is tokens[start].
                token: s.last_token,
                slot,
            },
            seq_id: s.id,
            gen,
        },
        drafts: d as u32,
    });
    if d > 0 {
        spec.queue_drafts(offset, d as u32);
    }
    s.num_computed = start + 1;
    if facts.caching && fills {
        // Registered in batches with the plain path's (`DecodeBatch::flush`).
        batch.queue_fill(h, start + 1);
    }
    Ok(SpecTurn::Taken(1 + d))
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
