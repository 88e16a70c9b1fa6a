//! `unified` (vLLM V1, the default): no phases. Every request catches its computed tokens
//! up to its tokens, running requests first, then (if nothing was preempted) swapped groups,
//! then new admissions, all within one token budget.
use crate::error::Result;

use super::output::StepOutput;
use super::plan::Cut;
use super::{Policy, Scheduler};

impl Scheduler {
    /// Returns whether any waiting request was admitted.
    pub(super) fn schedule_unified(
        &mut self,
        delay_passed: bool,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let mut left = self.cfg.max_num_batched_tokens;
        self.sort_running_by_rank();
        // Beyond V1: a waiting request may push strictly lower-ranked running ones out. This
        // runs before anything is scheduled, so no victim has work in this step's output.
        let made_room =
            self.cfg.policy == Policy::Priority && self.preempt_for_waiting(Cut::Split, out)?;
        if self.schedule_running(&mut left, Cut::Split, out)? {
            return Ok(false);
        }
        if !made_room {
            self.swap_in_groups(&mut left, Cut::Split, out)?;
        }
        if !delay_passed {
            return Ok(false);
        }
        self.admit_waiting(&mut left, Cut::Split, out)
    }
}
