//! Applying a verification step (speculative decoding): each sample brings a run of tokens
//! (its accepted drafts, then the target's own token), appended under the stop rules up to
//! where they end it (`stop::cut_run`); accepted drafts become computed, blocks they filled are
//! registered, blocks that held only rejected drafts are given back. The drafts themselves are
//! `features/spec/`'s.
use crate::error::{Error, Result};
use crate::ids::TokenId;

use super::stop::{cut_run, run_starts, FinishReason};
use super::update::{finish_seq, push_token};
use crate::scheduler::output::FinishedSeq;
use crate::scheduler::state::request::{Request, RequestStatus};
use crate::scheduler::state::step::check_token_ids;
use crate::scheduler::Scheduler;

impl Scheduler {
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
        self.kv.check_step_output()?;
        self.check_runs(sampled, num_tokens)?;
        // The ledger checks the step, the sample count and each run's first token; the
        // runs' other tokens were checked above.
        let firsts: Vec<i64> = run_starts(num_tokens)
            .map(|(start, _)| sampled[start])
            .collect();
        self.ledger.close_for_update(step, &firsts, stop_hit)?;
        self.spec.sample_drafts.clear();
        // Held outputs describe tables this update may shorten: snapshotted before the first
        // table that shrinks (most updates shorten none).
        let mut snapshotted = false;
        let max_len = self.cfg.max_seq_len();
        let la = self.cfg.num_lookahead_slots;
        let caching = self.caching();
        let mut finished = Vec::new();
        let mut any_request_done = false;
        // The scheduler's parts borrowed separately: a sequence and the manager at once.
        let Scheduler {
            store,
            mgr,
            queues,
            ledger,
            kv,
            recorder,
            ..
        } = self;
        let bs = mgr.block_size();
        for (k, (start, count)) in run_starts(num_tokens).enumerate() {
            let (h, gen, idx) = ledger.sample(k);
            if !store.is_live(h, gen) {
                continue;
            }
            let req = store.get_mut(h);
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
                    mgr,
                    kv,
                    queues,
                    &mut ledger.finished,
                    &mut finished,
                )?;
                continue;
            }
            // The run's first token was the one the row computed; the rest were drafts.
            let extra_key = req.extra_key;
            let s = &mut req.seqs[idx];
            let before = s.num_computed;
            s.num_computed += count - 1;
            let computed = s.num_computed;
            if caching && count > 1 && computed / bs > before / bs {
                mgr.cache_full_blocks(s.id, &s.tokens, computed, extra_key)?;
            }
            // Blocks past the accepted tokens held only rejected drafts: the mirror's length
            // is the manager's, so the common run that releases none asks nothing
            // (`computed + la` slots fit in one block fewer).
            if computed + la > s.table.num_blocks().saturating_sub(1) * bs {
                continue;
            }
            let id = s.id;
            if !snapshotted {
                recorder.materialize_pending(store);
                snapshotted = true;
            }
            let released = mgr.truncate_slots(id, computed + la)?;
            let table = &mut store.get_mut(h).seqs[idx].table;
            table.truncate(table.num_blocks() - released);
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
    // Common case: the run ends below the first length a stop rule can fire at (see
    // `StopParams::quiet_until`), so every token is in.
    if !hit && s.tokens.len() + run.len() < req.quiet_until {
        for &t in run {
            push_token(s, t as TokenId);
        }
        return None;
    }
    let (kept, fin) = cut_run(&req.stop, req.prompt_len, s.tokens.len(), run, hit, max_len);
    for &t in &run[..kept] {
        push_token(s, t as TokenId);
    }
    fin
}
