//! `chunked_prefill` (vLLM V0 chunked): decode-first steps that mix decodes and prompt
//! chunks. After the step `running` is re-ordered: swapped-in, decodes, prompts still being
//! chunked, newly admitted, so next step decodes come before unfinished chunks.
use crate::error::Result;

use super::output::StepOutput;
use super::plan::Cut;
use super::Scheduler;

impl Scheduler {
    /// Returns whether any waiting request was admitted.
    pub(super) fn schedule_chunked_prefill(
        &mut self,
        delay_passed: bool,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let mut left = self.cfg.max_num_batched_tokens;
        self.sort_running_by_rank();
        let preempted = self.schedule_running(&mut left, Cut::Split, out)?;
        let walked = self.running.len();
        let mut admitted = false;
        if !preempted {
            self.swap_in_groups(&mut left, Cut::Split, out)?;
        }
        let swapped_in_end = self.running.len();
        if !preempted && delay_passed {
            admitted = self.admit_waiting(&mut left, Cut::Split, out)?;
        }
        let prompts_among_walked = self.running[..walked]
            .iter()
            .any(|&h| !self.req(h).is_decoding());
        if swapped_in_end > walked || prompts_among_walked {
            let mut order = Vec::with_capacity(self.running.len());
            order.extend_from_slice(&self.running[walked..swapped_in_end]);
            order.extend(
                self.running[..walked]
                    .iter()
                    .filter(|&&h| self.req(h).is_decoding()),
            );
            order.extend(
                self.running[..walked]
                    .iter()
                    .filter(|&&h| !self.req(h).is_decoding()),
            );
            order.extend_from_slice(&self.running[swapped_in_end..]);
            self.running = order;
        }
        Ok(admitted)
    }
}
