//! Taking back a step whose computation failed (`discard_step`).
use std::collections::HashSet;

use crate::error::Result;

use crate::scheduler::output::StepOutput;
use crate::scheduler::state::queue::Queue;
use crate::scheduler::state::request::RequestStatus;
use crate::scheduler::stats::SchedulerCounters;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Takes back the latest step, whose computation failed (the caller could not run or
    /// sample it): every request it scheduled, and every group it swapped out, goes back to
    /// the head of `waiting` to be recomputed from its tokens (the KV written by the step,
    /// its copies and swaps may be missing or partial; generated tokens are kept), and the
    /// blocks it registered in the prefix cache are forgotten. Requests it finished as
    /// ignored stay finished. Returns the ids of the requests rolled back.
    pub fn discard_step(&mut self, out: &StepOutput) -> Result<Vec<String>> {
        // Its synchronous KV loads must be reported first: their blocks are written until then.
        self.kv.check_sync_loads_reported()?;
        self.ledger.close_for_discard(out.step)?;
        self.kv.clear_sync_failure();
        let mut touched: HashSet<u32> = out
            .handles
            .iter()
            .zip(&out.gens)
            .filter(|&(&h, &g)| self.store.is_live(h, g))
            .map(|(&h, _)| h)
            .collect();
        // Groups this step swapped out: their copy to host may not have happened.
        let swapped_out: Vec<u32> = out
            .preempted
            .iter()
            .filter_map(|id| self.store.handle_of(id))
            .filter(|&h| self.store.get(h).status == RequestStatus::Swapped)
            .collect();
        let counters = self.counters;
        let mut scratch = StepOutput::with_capacity(self.ledger.step, 0);
        let mut rolled_back = Vec::with_capacity(touched.len() + swapped_out.len());
        for &h in swapped_out.iter().rev() {
            self.queues.remove(Queue::Swapped, h);
            self.reset_to_recompute(h)?;
            rolled_back.push(self.store.get(h).id.clone());
        }
        // Tail first, as preemption victims are taken, so the requeue keeps running's order.
        let victims: Vec<u32> = self
            .queues
            .running
            .iter()
            .rev()
            .copied()
            .filter(|h| touched.remove(h))
            .collect();
        // Their blocks may lack their KV: a KV connector saves none of them.
        self.kv.discarding = true;
        let mut preempted = Ok(());
        for h in victims {
            self.queues.remove_running(h, &self.store);
            preempted = self.preempt(h, &mut scratch, true);
            if preempted.is_err() {
                break;
            }
            rolled_back.push(self.store.get(h).id.clone());
        }
        self.kv.discarding = false;
        preempted?;
        self.queues.requeue_preempted(&self.store);
        self.mgr.forget_step_registrations()?;
        // A rollback is not a preemption: the statistics keep counting real ones only.
        self.counters = SchedulerCounters {
            num_rolled_back_steps: counters.num_rolled_back_steps + 1,
            ..counters
        };
        Ok(rolled_back)
    }
}
