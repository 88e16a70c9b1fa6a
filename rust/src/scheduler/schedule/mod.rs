//! Deciding a step: `schedule(now)` seeds the step's budget, lets the strategy
//! (`strategies.rs`) order the phases below, and seals the output.
//!
//! - `running.rs` — the walk over `running`: the decode fast path (`decode.rs`; the draft
//!   fast path of `features/spec/` in a step with drafts), the general plan (`plan.rs`)
//!   otherwise, tail preemption (`preemption.rs`) when blocks run out;
//! - `admission.rs` — the one ladder that admits from `waiting` and swaps in from `swapped`
//!   (gates, feature conditions, the pool's NEVER / LATER / OK), and `delay_factor`;
//! - `preemption.rs` — swap or recompute, and the `priority` probe;
//! - `budget.rs` — what the step may still take.
pub(super) mod admission;
pub(super) mod budget;
pub(super) mod decode;
pub(super) mod plan;
mod preemption;
mod running;
mod strategies;

use crate::error::Result;
use crate::scheduler::{Scheduler, StepOutput, Strategy};

use budget::Budget;

impl Scheduler {
    /// Decides this step's work. `now` is in seconds on the clock of the arrival times
    /// (used by `delay_factor` only).
    pub fn schedule(&mut self, now: f64) -> Result<StepOutput> {
        // A KV connector's synchronous loads of the last step: reported, and a failed one's
        // step discarded (its registrations would otherwise stay).
        self.kv.check_step_output()?;
        let step = self.ledger.begin()?;
        self.mgr.begin_step();
        let mut out = self.recorder.next_output(step, &self.cfg);
        for (h, reason) in std::mem::take(&mut self.queues.pending_ignored) {
            self.finish_ignored(h, reason, &mut out)?;
        }
        let delay_passed = self
            .delay
            .passed(now, self.cfg.delay_factor, &self.queues, &self.store);
        let mut budget = Budget::new(self.cfg.strategy, self.cfg.max_num_batched_tokens);
        self.seed_lora_tally(&mut budget);
        self.queues.sort_running_by_rank(&self.store);
        let admitted = match self.cfg.strategy {
            Strategy::PrefillFirst => {
                self.schedule_prefill_first(&mut budget, delay_passed, &mut out)?
            }
            Strategy::ChunkedPrefill => {
                self.schedule_chunked_prefill(&mut budget, delay_passed, &mut out)?
            }
            Strategy::Unified => self.schedule_unified(&mut budget, delay_passed, &mut out)?,
        };
        self.delay.step_done(admitted);
        self.queues.requeue_preempted(&self.store);
        self.record_lora_ids(&mut out);
        self.recorder.seal(&mut out);
        self.seal_drafts(&mut out);
        self.seal_connector_meta(&mut out);
        self.ledger.open(&out);
        self.counters.num_steps += 1;
        self.counters.num_batched_tokens_total += out.num_batched_tokens as u64;
        Ok(out)
    }
}
