//! `prefill_first` (vLLM V0 default): a step is all prefills (whole prompts, admitted while
//! nothing is swapped out, or under `priority` when they outrank every swapped group) or
//! all decodes (with tail preemption, then swap-in).
use crate::error::Result;

use super::output::StepOutput;
use super::plan::Cut;
use super::{Policy, Scheduler};

impl Scheduler {
    /// Returns whether any waiting request was admitted (a prefill step).
    pub(super) fn schedule_prefill_first(
        &mut self,
        delay_passed: bool,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let mut left = self.cfg.max_num_batched_tokens;
        self.sort_running_by_rank();
        // Under `priority` the victims go first, so the request they make room for is
        // admitted in this very step (a step that only preempts computes nothing).
        let made_room =
            self.cfg.policy == Policy::Priority && self.preempt_for_waiting(Cut::Whole, out)?;
        // `admit_waiting` keeps admission closed while groups are swapped out (under
        // `priority`, open to requests that outrank them).
        if delay_passed && self.admit_waiting(&mut left, Cut::Whole, out)? {
            return Ok(true);
        }
        let preempted = made_room | self.schedule_running(&mut left, Cut::Whole, out)?;
        if !preempted {
            self.swap_in_groups(&mut left, Cut::Whole, out)?;
        }
        Ok(false)
    }
}
