//! The walk over `running`, shared by the strategies: each request gets its tokens (the
//! decode fast path first, the general planner otherwise); when blocks run out, requests are
//! preempted from the tail (the lowest-ranked) until the current one fits or is itself
//! preempted.
use crate::error::Result;

use super::budget::{Budget, Cut};
use super::decode::fast_decode_run;
use crate::scheduler::features::spec::spec_fast_run;
use crate::scheduler::output::StepOutput;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Walks `running` in order giving each request its tokens. Under `Cut::Whole` the walk
    /// stops at the first request the budget cannot take whole. Returns whether anything was
    /// preempted.
    pub(super) fn schedule_running(
        &mut self,
        budget: &mut Budget,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let cut = budget.cut;
        let mut preempted = false;
        self.batch.drop_fills();
        let facts = self.fast_decode_facts();
        // The budget's tokens live in a local for the walk (a register on the fast path).
        let mut left = budget.tokens;
        let mut i = 0;
        while i < self.queues.running.len() && left > 0 {
            // The fast path takes what it can from here on (flushing as its batch fills); a step
            // with drafts has its own (`features/spec/fast_path.rs`: a draft row is no
            // single-token decode). Each takes only the parts it touches: the slots, the
            // manager, the batch of registrations (and the drafts).
            let running = &self.queues.running[i..];
            let (store, mgr, batch) = (&mut self.store, &mut self.mgr, &mut self.batch);
            let (taken, used) = if self.spec.has_pending() {
                spec_fast_run(running, left, facts, store, mgr, batch, &mut self.spec, out)?
            } else {
                let taken = fast_decode_run(running, left, facts, store, mgr, batch, out)?;
                (taken, taken)
            };
            left -= used;
            i += taken;
            if i >= self.queues.running.len() || left == 0 {
                break;
            }
            let h = self.queues.running[i];
            self.batch.flush(&self.store, &mut self.mgr)?;
            let (tokens, needed) = self.plan_request(h, left, cut);
            if tokens == 0 {
                if cut == Cut::Whole {
                    break;
                }
                i += 1;
                continue;
            }
            loop {
                if needed == 0 || needed <= self.mgr.num_free_device_blocks() {
                    self.apply_plan(h, out)?;
                    left -= tokens;
                    i += 1;
                    break;
                }
                if self.queues.running.len() == 1 && self.has_pending_transfers() {
                    // Alone and short while a KV connector's transfers hold blocks: they
                    // come back once reported, so it waits (keeping its blocks) meanwhile.
                    i += 1;
                    break;
                }
                if self.queues.running.len() == 1 {
                    // Alone and still short: only this request holds device blocks, so it
                    // can never grow. Preempting it would only bring it back (a livelock).
                    self.queues.pop_running(&self.store);
                    let reason = format!(
                        "needs {needed} more KV blocks with the whole cache ({} blocks) to \
                         itself",
                        self.mgr.num_device_blocks()
                    );
                    self.finish_ignored(h, reason, out)?;
                    break;
                }
                let victim = self
                    .queues
                    .pop_running(&self.store)
                    .expect("running holds the current request");
                self.preempt(victim, out, false)?;
                preempted = true;
                if victim == h {
                    break;
                }
            }
        }
        self.batch.flush(&self.store, &mut self.mgr)?;
        budget.tokens = left;
        Ok(preempted)
    }
}
