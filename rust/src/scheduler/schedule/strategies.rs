//! The three strategies, one planner each: they differ only in the order of the phases of a
//! step (the `priority` probe, the walk over `running`, swap-ins, admission from `waiting`);
//! `Scheduler::schedule` picks one by `SchedulerConfig::strategy`. Each returns whether any
//! waiting request was admitted (what `delay_factor` counts as a prefill step).
use crate::error::Result;

use super::budget::Budget;
use crate::scheduler::output::StepOutput;
use crate::scheduler::state::queue::Queue;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// `unified` (vLLM V1, the default): no phases. Every request catches its computed
    /// tokens up to its tokens, running requests first, then (if nothing was preempted)
    /// swapped groups, then new admissions, all within one token budget.
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

    /// `prefill_first` (vLLM V0 default): a step is all prefills (whole prompts) or all
    /// decodes (with tail preemption, then swap-in).
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

    /// `chunked_prefill` (vLLM V0 chunked): decode-first steps that mix decodes and prompt
    /// chunks. After the step `running` is re-ordered: swapped-in, decodes, prompts still
    /// being chunked, newly admitted, so next step decodes come before unfinished chunks.
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
