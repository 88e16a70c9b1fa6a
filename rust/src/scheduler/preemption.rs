//! Preemption: recompute (free the blocks, back to the head of `waiting`, generated tokens
//! kept) or swap (blocks to host memory, into `swapped`), and the `priority` rule that lets a
//! waiting request push strictly lower-ranked running ones out.
use crate::error::Result;
use crate::kv::AllocStatus;

use super::output::StepOutput;
use super::plan::Cut;
use super::request::rank_less;
use super::{PreemptionMode, RequestStatus, Scheduler};

impl Scheduler {
    /// Preempts running request `h` (already removed from `running`). Swap is chosen per
    /// the mode (`Auto`: when more than one sequence runs) unless `force_recompute`, and
    /// falls back to recompute when the host pool cannot take the group.
    pub(super) fn preempt(
        &mut self,
        h: u32,
        out: &mut StepOutput,
        force_recompute: bool,
    ) -> Result<()> {
        // Its tables are about to be cleared: outputs still listing them get snapshots.
        self.materialize_pending();
        let req = self.slots[h as usize]
            .req
            .as_mut()
            .expect("preempted request exists");
        self.seq_scratch.clear();
        self.seq_scratch
            .extend(req.active_seqs().map(|i| req.seqs[i].id));
        let several_running = req.forked && req.num_unfinished > 1;
        let want_swap = !force_recompute
            && match self.cfg.preemption_mode {
                PreemptionMode::Auto => several_running,
                PreemptionMode::Swap => true,
                PreemptionMode::Recompute => false,
            };
        let active: Vec<usize> = req.active_seqs().collect();
        if want_swap && self.mgr.can_swap_out(&self.seq_scratch) {
            let pairs = self.mgr.swap_out(&self.seq_scratch)?;
            for (device, host) in pairs {
                out.blocks_to_swap_out.push(device as i64);
                out.blocks_to_swap_out.push(host as i64);
            }
            for i in active {
                req.seqs[i].table.clear();
            }
            req.status = RequestStatus::Swapped;
            self.preempted_swap.push(h);
            self.counters.num_preemptions_swap += 1;
        } else {
            for &id in &self.seq_scratch {
                self.mgr.free(id)?;
            }
            for i in active {
                let s = &mut req.seqs[i];
                s.num_computed = 0;
                s.table.clear();
                s.tail_shared = false;
            }
            req.forked = false;
            req.status = RequestStatus::Preempted;
            self.preempted_recompute.push(h);
            self.counters.num_preemptions_recompute += 1;
        }
        self.running_seats -= req.seats();
        out.preempted.push(req.id.clone());
        Ok(())
    }

    /// `priority`: while the best waiting request cannot be admitted (blocks or seats) and
    /// the lowest-ranked running request ranks strictly below it, preempt that one by
    /// recompute. `running` must be sorted by rank. Returns whether anything was preempted.
    pub(super) fn preempt_for_waiting(&mut self, cut: Cut, out: &mut StepOutput) -> Result<bool> {
        let la = self.cfg.num_lookahead_slots;
        let mut any = false;
        while let (Some(&w), Some(&r)) = (self.waiting.front(), self.running.last()) {
            if !self.admission_open_for(w) || !rank_less(self.req(w).rank(), self.req(r).rank()) {
                break;
            }
            let seats_ok = self.running_seats + self.req(w).seats() <= self.cfg.max_num_seqs;
            let status = {
                let req = self.req(w);
                let tokens = &req.seqs[req.leader()].tokens[..req.leader_target()];
                // Read-only lookup: the counted one happens at admission.
                let hit = if self.caching {
                    self.mgr.find_prefix(tokens, req.extra_key)
                } else {
                    Default::default()
                };
                let want = tokens.len() - hit.num_cached_tokens;
                let first = match cut {
                    Cut::Whole => want,
                    Cut::Split => want.min(self.cfg.max_num_batched_tokens).min(
                        match self.cfg.long_prefill_token_threshold {
                            0 => usize::MAX,
                            t => t,
                        },
                    ),
                };
                self.mgr
                    .can_allocate_with_prefix(&hit, hit.num_cached_tokens + first + la)
            };
            if status == AllocStatus::Never || (seats_ok && status == AllocStatus::Ok) {
                break;
            }
            self.running.pop();
            self.preempt(r, out, true)?;
            any = true;
        }
        Ok(any)
    }
}
