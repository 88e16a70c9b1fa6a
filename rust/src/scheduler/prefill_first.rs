//! `prefill_first` (vLLM V0 default): a step is all prefills (whole prompts, admitted while
//! nothing is swapped out) or all decodes (with tail preemption, then swap-in).
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
        if self.swapped.is_empty()
            && delay_passed
            && self.admit_waiting(&mut left, Cut::Whole, out)?
        {
            return Ok(true);
        }
        self.sort_running_by_rank();
        let mut preempted =
            self.cfg.policy == Policy::Priority && self.preempt_for_waiting(Cut::Whole, out)?;
        preempted |= self.schedule_running(&mut left, Cut::Whole, out)?;
        if !preempted {
            self.swap_in_groups(&mut left, Cut::Whole, out)?;
        }
        Ok(false)
    }
}
