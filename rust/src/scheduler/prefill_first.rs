//! `prefill_first` (vLLM V0 default): a step is all prefills (whole prompts) or all decodes
//! (with tail preemption, then swap-in).
use crate::error::Result;

use super::budget::Budget;
use super::output::StepOutput;
use super::state::queue::Queue;
use super::Scheduler;

impl Scheduler {
    /// Returns whether any waiting request was admitted (a prefill step).
    pub(super) fn schedule_prefill_first(
        &mut self,
        budget: &mut Budget,
        delay_passed: bool,
        out: &mut StepOutput,
    ) -> Result<bool> {
        // Under `priority` the victims go first, so the request they make room for is
        // admitted in this very step (a step that only preempts computes nothing).
        let made_room = self.preempt_for_waiting(budget, out)?;
        if delay_passed && self.admit_from(Queue::Waiting, budget, out)? {
            return Ok(true);
        }
        let preempted = made_room | self.schedule_running(budget, out)?;
        if !preempted {
            self.admit_from(Queue::Swapped, budget, out)?;
        }
        Ok(false)
    }
}
