//! Scheduler configuration: strategy, policy, preemption mode and budgets.
use crate::error::{Error, Result};

/// How a step is composed (SPEC §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// vLLM V0 default: a step is all prefills (whole prompts) or all decodes.
    PrefillFirst,
    /// vLLM V0 chunked prefill: decodes first, then prompt chunks, in one step.
    ChunkedPrefill,
    /// vLLM V1: every request just catches up `num_computed_tokens` to `num_tokens`.
    Unified,
}

impl Strategy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "prefill_first" => Ok(Strategy::PrefillFirst),
            "chunked_prefill" => Ok(Strategy::ChunkedPrefill),
            "unified" => Ok(Strategy::Unified),
            _ => Err(Error::InvalidArgument(format!(
                "scheduling must be 'unified', 'prefill_first' or 'chunked_prefill', got {s:?}"
            ))),
        }
    }
}

/// Queue order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// By arrival (insertion order; recompute-preempted requests go back to the head).
    Fcfs,
    /// By (priority, arrival); lower priority value is more urgent.
    Priority,
}

impl Policy {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => Ok(Policy::Priority),
            _ => Err(Error::InvalidArgument(format!(
                "policy must be 'fcfs' or 'priority', got {s:?}"
            ))),
        }
    }
}

/// What happens to a preempted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Swap groups with more than one running sequence, recompute the others; recompute
    /// when host space is short.
    Auto,
    /// Free the blocks and compute the tokens again later.
    Recompute,
    /// Move the blocks to host memory (recompute when host space is short).
    Swap,
}

impl PreemptionMode {
    pub fn parse(s: Option<&str>) -> Result<Self> {
        match s {
            None => Ok(PreemptionMode::Auto),
            Some("recompute") => Ok(PreemptionMode::Recompute),
            Some("swap") => Ok(PreemptionMode::Swap),
            Some(other) => Err(Error::InvalidArgument(format!(
                "preemption_mode must be None, 'recompute' or 'swap', got {other:?}"
            ))),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub strategy: Strategy,
    pub policy: Policy,
    pub preemption_mode: PreemptionMode,
    /// Cap on the tokens one sequence computes per step (0 = no cap).
    pub long_prefill_token_threshold: usize,
    /// Extra slots allocated past each sequence's computed tokens (speculative decoding).
    pub num_lookahead_slots: usize,
    /// Hold admission back until the oldest waiting request has waited this many times the
    /// last prefill step's latency (0 = off).
    pub delay_factor: f64,
}

impl SchedulerConfig {
    /// The budget `max_num_batched_tokens=None` stands for: `prefill_first` must fit a whole
    /// prompt of `max_model_len`, the chunking strategies take V1's default.
    pub fn default_batched_tokens(strategy: Strategy, max_model_len: usize) -> usize {
        match strategy {
            Strategy::PrefillFirst => max_model_len.max(2048),
            Strategy::ChunkedPrefill | Strategy::Unified => 8192,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(m.to_string()));
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be >= 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be >= 1");
        }
        if self.max_model_len < 2 {
            return bad("max_model_len must be >= 2 (a prompt token and a generated one)");
        }
        if !(self.delay_factor >= 0.0 && self.delay_factor.is_finite()) {
            return bad("delay_factor must be a finite number >= 0");
        }
        Ok(())
    }

    /// Longest sequence this configuration can hold. `prefill_first` never splits a prompt,
    /// and a preempted sequence is recomputed in one step, so it is also bounded by the budget.
    pub fn max_seq_len(&self) -> usize {
        match self.strategy {
            Strategy::PrefillFirst => self.max_model_len.min(self.max_num_batched_tokens),
            _ => self.max_model_len,
        }
    }
}
