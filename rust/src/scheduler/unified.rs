//! `unified` (vLLM V1, the default): no phases. Every request catches its computed tokens
//! up to its tokens, running requests first, then (if nothing was preempted) swapped groups,
//! then new admissions, all within one token budget.
use crate::error::Result;

use super::budget::Budget;
use super::output::StepOutput;
use super::state::queue::Queue;
use super::Scheduler;

impl Scheduler {
    /// Returns whether any waiting request was admitted.
    pub(super) fn schedule_unified(
        &mut self,
        budget: &mut Budget,
        delay_passed: bool,
        out: &mut StepOutput,
    ) -> Result<bool> {
        // Beyond V1: under `priority` a waiting request may push strictly lower-ranked
        // running ones out, before anything is scheduled.
        let made_room = self.preempt_for_waiting(budget, out)?;
        if self.schedule_running(budget, out)? {
            return Ok(false);
        }
        if !made_room {
            self.admit_from(Queue::Swapped, budget, out)?;
        }
        if !delay_passed {
            return Ok(false);
        }
        self.admit_from(Queue::Waiting, budget, out)
    }
}
