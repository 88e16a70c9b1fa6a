//! `chunked_prefill` (vLLM V0 chunked): decode-first steps that mix decodes and prompt
//! chunks. After the step `running` is re-ordered: swapped-in, decodes, prompts still being
//! chunked, newly admitted, so next step decodes come before unfinished chunks.
use crate::error::Result;

use super::budget::Budget;
use super::output::StepOutput;
use super::state::queue::Queue;
use super::Scheduler;

impl Scheduler {
    /// Returns whether any waiting request was admitted.
    pub(super) fn schedule_chunked_prefill(
        &mut self,
        budget: &mut Budget,
        delay_passed: bool,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let preempted = self.schedule_running(budget, out)?;
        let walked = self.queues.running.len();
        let mut admitted = false;
        if !preempted {
            self.admit_from(Queue::Swapped, budget, out)?;
        }
        let swapped_in_end = self.queues.running.len();
        if !preempted && delay_passed {
            admitted = self.admit_from(Queue::Waiting, budget, out)?;
        }
        let (store, running) = (&self.store, &mut self.queues.running);
        let decoding = |h: &u32| store.get(*h).is_decoding();
        let prompts_among_walked = !running[..walked].iter().all(decoding);
        if swapped_in_end > walked || prompts_among_walked {
            let mut order = Vec::with_capacity(running.len());
            order.extend_from_slice(&running[walked..swapped_in_end]);
            order.extend(running[..walked].iter().filter(|h| decoding(h)));
            order.extend(running[..walked].iter().filter(|h| !decoding(h)));
            order.extend_from_slice(&running[swapped_in_end..]);
            *running = order;
        }
        Ok(admitted)
    }
}
