//! Preemption: recompute (free the blocks, back to the head of `waiting`, generated tokens
//! kept) or swap (blocks to host memory, into `swapped`), and the `priority` probe that lets a
//! waiting request push strictly lower-ranked running ones out.
use crate::error::Result;
use crate::kv::{AllocStatus, PrefixHit};

use super::admission::{Short, Verdict};
use super::budget::{Budget, Cut};
use crate::scheduler::output::StepOutput;
use crate::scheduler::state::queue::Queue;
use crate::scheduler::state::request::{rank_less, RequestStatus};
use crate::scheduler::{Policy, PreemptionMode, Scheduler};

impl Scheduler {
    /// Preempts request `h`, already taken out of `running`. Swap is chosen per the mode
    /// (`Auto`: when more than one sequence runs) unless `force_recompute`, and falls back to
    /// recompute when the host pool cannot take the group.
    pub(in crate::scheduler) fn preempt(
        &mut self,
        h: u32,
        out: &mut StepOutput,
        force_recompute: bool,
    ) -> Result<()> {
        // Its tables are about to be cleared: outputs still listing them get snapshots.
        self.recorder.materialize_pending(&self.store);
        let req = self.store.get(h);
        self.planner.group_of(req);
        let several_running = req.forked && req.num_unfinished > 1;
        let want_swap = !force_recompute
            && match self.cfg.preemption_mode {
                PreemptionMode::Auto => several_running,
                PreemptionMode::Swap => true,
                PreemptionMode::Recompute => false,
            };
        if want_swap && self.mgr.can_swap_out(&self.planner.group) {
            // (device, host) pairs.
            let pairs = self.mgr.swap_out(&self.planner.group)?;
            StepOutput::push_pairs(&mut out.blocks_to_swap_out, pairs);
            let req = self.store.get_mut(h);
            for s in req.active_seqs_mut() {
                s.table.clear();
            }
            req.status = RequestStatus::Swapped;
            self.queues.preempted_swap.push(h);
            self.counters.num_preemptions_swap += 1;
        } else {
            if self.kv.is_attached() {
                self.save_before_recompute(h)?;
            }
            self.reset_to_recompute(h)?;
            self.counters.num_preemptions_recompute += 1;
        }
        out.preempted.push(self.store.get(h).id.clone());
        Ok(())
    }

    /// Sends request `h` (out of every queue) back to be computed again from its tokens: its
    /// active sequences give back whatever blocks they hold (device or host) and forget their
    /// progress; it goes to the head of `waiting` with `requeue_preempted`. The one reset of
    /// recompute preemption and of a swapped group dropped by `discard_step`.
    pub(in crate::scheduler) fn reset_to_recompute(&mut self, h: u32) -> Result<()> {
        let req = self.store.get_mut(h);
        for s in req.active_seqs_mut() {
            if self.mgr.contains(s.id) {
                self.mgr.free(s.id)?;
            }
            s.reset_progress();
        }
        req.forked = false;
        req.status = RequestStatus::Preempted;
        self.queues.preempted_recompute.push(h);
        Ok(())
    }

    /// `priority` only: while the best waiting request cannot be admitted (blocks or seats)
    /// and the lowest-ranked running request ranks strictly below it, preempt that one by
    /// recompute. Runs before anything is scheduled (no victim has work in this step's
    /// output), with `running` sorted by rank. Returns whether anything was preempted.
    pub(super) fn preempt_for_waiting(
        &mut self,
        budget: &Budget,
        out: &mut StepOutput,
    ) -> Result<bool> {
        if self.cfg.policy != Policy::Priority {
            return Ok(false);
        }
        let mut any = false;
        while let (Some(&w), Some(&r)) = (self.queues.waiting.front(), self.queues.running.last()) {
            if !rank_less(self.store.get(w).rank(), self.store.get(r).rank()) {
                break;
            }
            // The admission ladder's gates: preempting helps only a request short of seats
            // (or, below, of blocks).
            let short_of_seats = match self.gates(w, Queue::Waiting, budget) {
                None => false,
                Some(Verdict::Later(Short::Seats)) => true,
                Some(_) => break,
            };
            match self.first_chunk_status(w, budget) {
                AllocStatus::Never => break,
                AllocStatus::Ok if !short_of_seats => break,
                _ => {}
            }
            self.queues.pop_running(&self.store);
            self.preempt(r, out, true)?;
            any = true;
        }
        Ok(any)
    }

    /// The pool's answer for waiting request `h`'s first chunk, from a read-only prefix
    /// lookup (the counted one happens at admission) and the whole step's budget.
    fn first_chunk_status(&self, h: u32, budget: &Budget) -> AllocStatus {
        let la = self.cfg.num_lookahead_slots;
        let req = self.store.get(h);
        let tokens = &req.seqs[req.leader()].tokens[..req.leader_target()];
        let hit = if self.caching() {
            self.mgr.find_prefix(tokens, req.extra_key)
        } else {
            PrefixHit::default()
        };
        let want = tokens.len() - hit.num_cached_tokens;
        // Under `Whole` a waiting request's tokens never exceed the budget (`max_seq_len`),
        // so its first chunk is all of them.
        let first = budget
            .cut
            .take(want, self.cfg.max_num_batched_tokens, self.chunk_cap());
        debug_assert!(first == want || budget.cut == Cut::Split);
        self.mgr
            .can_allocate_with_prefix(&hit, hit.num_cached_tokens + first + la)
    }
}
