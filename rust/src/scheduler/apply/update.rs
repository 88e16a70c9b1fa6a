//! Applying a computed step: `update_from_output` appends each sampled token to its
//! sequence, applies the stop rules (`stop.rs`) and frees what finished.
use crate::error::Result;
use crate::ids::TokenId;

use crate::kv::KvCacheManager;

use super::stop::FinishReason;
use crate::scheduler::features::connector::ConnectorState;
use crate::scheduler::output::FinishedSeq;
use crate::scheduler::state::queue::Queues;
use crate::scheduler::state::request::{Request, RequestStatus, Seqs, Sequence};
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Takes one sampled token per sample of the latest output (`sampled[k]` belongs to
    /// `sample_seq_ids[k]`), appends it, applies the stop rules and frees what finished.
    /// `stop_hit[k]` (optional) finishes that sequence as stopped (a stop string matched).
    pub fn update_from_output(
        &mut self,
        step: u64,
        sampled: &[i64],
        stop_hit: Option<&[bool]>,
    ) -> Result<Vec<FinishedSeq>> {
        // A KV connector's synchronous loads of the step: reported, none failed.
        self.kv.check_step_output()?;
        self.ledger.close_for_update(step, sampled, stop_hit)?;
        let max_len = self.cfg.max_seq_len();
        let mut finished = Vec::new();
        let mut any_request_done = false;
        // The scheduler's parts borrowed separately, the slots as a local slice: the loop
        // keeps them in registers.
        let Scheduler {
            store,
            mgr,
            queues,
            ledger,
            kv,
            ..
        } = self;
        let slots = store.slots_mut();
        let n = sampled.len();
        let (handles, gens, seq_index) = (
            &ledger.handles[..n],
            &ledger.gens[..n],
            &ledger.seq_index[..n],
        );
        for i in 0..n {
            let (h, gen, idx, token) = (handles[i], gens[i], seq_index[i] as u32, sampled[i]);
            // Aborted since the schedule() call: nothing to append to.
            let slot = &mut slots[h as usize];
            if slot.gen != gen {
                continue;
            }
            let Some(req) = slot.req.as_mut() else {
                continue;
            };
            if req.status != RequestStatus::Running {
                continue;
            }
            let seq = match &mut req.seqs {
                // Single-sequence requests (inline in the slot): no slice bounds to check.
                Seqs::One(s) if idx == 0 => s,
                Seqs::Many(v) => match v.get_mut(idx as usize) {
                    Some(s) => s,
                    None => continue,
                },
                Seqs::One(_) => continue,
            };
            if seq.is_finished() {
                continue;
            }
            let token = token as TokenId;
            let total = push_token(seq, token);
            let hit = stop_hit.is_some_and(|s| s[i]);
            // Common case: no rule can fire yet; skips the stop parameters' cache line.
            if !hit && total < req.quiet_until {
                continue;
            }
            let prompt_len = req.prompt_len;
            let fin = if hit {
                Some((FinishReason::Stop, None))
            } else {
                req.stop.check(token, total - prompt_len, total, max_len)
            };
            let Some((reason, stop_reason)) = fin else {
                continue;
            };
            // Out of line: once per sequence, and the loop keeps its registers.
            any_request_done |= finish_seq(
                req,
                h,
                idx,
                (reason, stop_reason),
                mgr,
                kv,
                queues,
                &mut ledger.finished,
                &mut finished,
            )?;
        }
        self.settle_finished(any_request_done)?;
        Ok(finished)
    }

    /// The end of every update (one token or a run per sample): the block-table mirrors of the
    /// sequences that finished are cleared, once pending outputs hold their snapshots, and the
    /// requests that finished with them are released.
    pub(super) fn settle_finished(&mut self, any_request_done: bool) -> Result<()> {
        if !self.ledger.finished.is_empty() {
            self.recorder.materialize_pending(&self.store);
            for &(h, idx) in &self.ledger.finished {
                if let Some(req) = self.store.try_get_mut(h) {
                    req.seqs[idx as usize].table.clear();
                }
            }
        }
        if any_request_done {
            let mut done = Vec::new();
            self.queues.take_finished(&self.store, &mut done);
            for h in done {
                self.release(h)?;
                self.counters.num_finished += 1;
            }
        }
        Ok(())
    }
}

/// Appends a sampled token to `seq` (its history and its last token); returns its length.
/// Growth is out of line, so the update loops have no call on their common path.
#[inline(always)]
pub(super) fn push_token(seq: &mut Sequence, token: TokenId) -> usize {
    if seq.tokens.len() == seq.tokens.capacity() {
        grow_tokens(&mut seq.tokens);
    }
    seq.tokens.push(token);
    seq.last_token = token;
    seq.tokens.len()
}

/// Room for one more token (as `push` would grow it), out of line.
#[cold]
#[inline(never)]
fn grow_tokens(tokens: &mut Vec<TokenId>) {
    tokens.reserve(1);
}

/// A sequence of the request in slot `h` just finished (`update_from_output`): marks it,
/// frees its blocks and seat, finishes the request with its last sequence, and reports it.
/// Returns whether the request finished.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub(super) fn finish_seq(
    req: &mut Request,
    h: u32,
    idx: u32,
    (reason, stop_reason): (FinishReason, Option<TokenId>),
    mgr: &mut KvCacheManager,
    kv: &mut ConnectorState,
    queues: &mut Queues,
    ledger_finished: &mut Vec<(u32, u32)>,
    finished: &mut Vec<FinishedSeq>,
) -> Result<bool> {
    let seq = &mut req.seqs[idx as usize];
    seq.finished = Some((reason, stop_reason));
    // The mirror is cleared by the caller, once pending outputs have their snapshots.
    ledger_finished.push((h, idx));
    let seq_id = seq.id;
    // A KV connector may save the last sequence's blocks: they stay allocated until it is done.
    let held = kv.is_attached() && req.num_unfinished == 1 && kv.hold(req, mgr).is_some();
    if !held && mgr.contains(seq_id) {
        mgr.free(seq_id)?;
    }
    req.num_unfinished -= 1;
    queues.seat_freed();
    let request_finished = req.num_unfinished == 0;
    if request_finished {
        req.status = match reason {
            FinishReason::Stop => RequestStatus::FinishedStopped,
            FinishReason::Length => RequestStatus::FinishedLengthCapped,
        };
    }
    finished.push(FinishedSeq {
        request_id: req.id.clone(),
        seq_index: idx as usize,
        reason,
        stop_reason,
        request_finished,
    });
    Ok(request_finished)
}
