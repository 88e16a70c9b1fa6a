//! The step ledger: which step is the latest, whether it is still open (neither applied by
//! `update_from_output` nor taken back by `discard_step`) and still owes its samples, and the
//! sample columns `update_from_output` walks.
use crate::error::{Error, Result};
use crate::ids::TokenId;

use crate::scheduler::output::StepOutput;

#[derive(Debug, Default)]
pub(in crate::scheduler) struct StepLedger {
    /// Number of the latest step (0 before the first).
    pub(in crate::scheduler) step: u64,
    /// The latest output has samples that `update_from_output` has not taken yet.
    awaiting_update: bool,
    /// The latest output was neither applied (`update_from_output`) nor discarded yet.
    step_open: bool,
    /// Slot, generation and sequence index of each sample of the latest output (copies of
    /// the output's sample columns: three memcpys instead of a zipped gather).
    pub(in crate::scheduler) handles: Vec<u32>,
    pub(in crate::scheduler) gens: Vec<u32>,
    pub(in crate::scheduler) seq_index: Vec<i32>,
    /// (slot, sequence index) of the sequences `update_from_output` finished (scratch).
    pub(in crate::scheduler) finished: Vec<(u32, u32)>,
}

impl StepLedger {
    /// Starts the next step; refused while the latest one owes its samples.
    pub(in crate::scheduler) fn begin(&mut self) -> Result<u64> {
        if self.awaiting_update {
            return Err(Error::InvalidState(format!(
                "step {} has samples waiting: call update_from_output (or discard_step, if \
                 the step was not computed) before schedule()",
                self.step
            )));
        }
        self.step += 1;
        Ok(self.step)
    }

    /// Opens the scheduled output: its samples are owed to `update_from_output`.
    pub(in crate::scheduler) fn open(&mut self, out: &StepOutput) {
        self.handles.clear();
        self.handles.extend_from_slice(&out.sample_handles);
        self.gens.clear();
        self.gens.extend_from_slice(&out.sample_gens);
        self.seq_index.clear();
        self.seq_index.extend_from_slice(&out.sample_seq_index);
        self.awaiting_update = !self.handles.is_empty();
        self.step_open = true;
    }

    /// Whether `step` is the latest step and still open (neither applied nor discarded): its
    /// sequences' live KV tables are still the ones it was scheduled with.
    pub(in crate::scheduler) fn is_open(&self, step: u64) -> bool {
        step == self.step && self.step_open
    }

    /// Where sample `k` of the latest output goes: (request slot, the slot's generation at
    /// schedule time, sequence index).
    pub(in crate::scheduler) fn sample(&self, k: usize) -> (u32, u32, usize) {
        (self.handles[k], self.gens[k], self.seq_index[k] as usize)
    }

    /// Refuses a step that is not the latest one or whose samples were already applied.
    pub(in crate::scheduler) fn check_latest(&self, step: u64) -> Result<()> {
        if step != self.step {
            return Err(Error::InvalidState(format!(
                "output of step {step} is not the latest (step {})",
                self.step
            )));
        }
        if !self.awaiting_update && !self.handles.is_empty() {
            return Err(Error::InvalidState(format!(
                "the samples of step {step} were already applied"
            )));
        }
        Ok(())
    }

    /// Checks an `update_from_output` call against the latest step and closes the step;
    /// empties the list of sequences the update finishes.
    pub(in crate::scheduler) fn close_for_update(
        &mut self,
        step: u64,
        sampled: &[i64],
        stop_hit: Option<&[bool]>,
    ) -> Result<()> {
        self.check_latest(step)?;
        let k = self.handles.len();
        if sampled.len() != k {
            return Err(Error::InvalidArgument(format!(
                "sampled_token_ids has {} entries, step {step} has {k} samples",
                sampled.len()
            )));
        }
        if let Some(hit) = stop_hit {
            if hit.len() != k {
                return Err(Error::InvalidArgument(format!(
                    "stop_string_hit has {} entries, step {step} has {k} samples",
                    hit.len()
                )));
            }
        }
        check_token_ids(sampled)?;
        self.awaiting_update = false;
        self.step_open = false;
        self.finished.clear();
        Ok(())
    }

    /// Checks a `discard_step` call against the latest step and closes the step, dropping
    /// its samples.
    pub(in crate::scheduler) fn close_for_discard(&mut self, step: u64) -> Result<()> {
        if step != self.step || !self.step_open {
            return Err(Error::InvalidState(format!(
                "only the latest step can be discarded, before update_from_output (step {}, \
                 latest {}{})",
                step,
                self.step,
                if self.step_open {
                    ""
                } else {
                    ", already applied or discarded"
                }
            )));
        }
        self.step_open = false;
        self.awaiting_update = false;
        self.handles.clear();
        self.gens.clear();
        self.seq_index.clear();
        Ok(())
    }
}

/// Every sampled id is a valid token id (0..=TokenId::MAX). A valid id has no bit above the
/// low 32 as a u64 and a negative one has them all: one branch-free OR over the samples, and
/// the first bad one is looked for only if there is one.
pub(in crate::scheduler) fn check_token_ids(sampled: &[i64]) -> Result<()> {
    const HIGH: u64 = !(TokenId::MAX as u64);
    if sampled.iter().fold(0u64, |acc, &t| acc | t as u64) & HIGH == 0 {
        return Ok(());
    }
    match sampled
        .iter()
        .position(|&t| t < 0 || t > TokenId::MAX as i64)
    {
        Some(i) => Err(Error::InvalidArgument(format!(
            "sampled_token_ids[{i}] = {} is not a valid token id",
            sampled[i]
        ))),
        None => Ok(()),
    }
}
