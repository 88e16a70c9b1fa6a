//! Scheduler configuration: strategy, policy, preemption mode and budgets.
use crate::error::{Error, Result};
use crate::spec::NgramConfig;

/// How a step is composed.
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
    /// Every strategy, the default first.
    pub const ALL: [Strategy; 3] = [
        Strategy::Unified,
        Strategy::PrefillFirst,
        Strategy::ChunkedPrefill,
    ];

    /// The name the Python API uses (`scheduling=`).
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::Unified => "unified",
            Strategy::PrefillFirst => "prefill_first",
            Strategy::ChunkedPrefill => "chunked_prefill",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        parse_name("scheduling", s, &Self::ALL, |v| v.as_str())
    }
}

/// The value of `all` named `s`, else an error listing the names.
fn parse_name<T: Copy>(
    what: &str,
    s: &str,
    all: &[T],
    name: impl Fn(T) -> &'static str,
) -> Result<T> {
    all.iter().copied().find(|&v| name(v) == s).ok_or_else(|| {
        let names: Vec<String> = all.iter().map(|&v| format!("'{}'", name(v))).collect();
        Error::InvalidArgument(format!(
            "{what} must be one of {}, got {s:?}",
            names.join(", ")
        ))
    })
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
    /// Every policy, the default first.
    pub const ALL: [Policy; 2] = [Policy::Fcfs, Policy::Priority];

    /// The name the Python API uses (`policy=`).
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        parse_name("policy", s, &Self::ALL, |v| v.as_str())
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
    /// Every mode, the default (`None` in Python: chosen per group) first.
    pub const ALL: [PreemptionMode; 3] = [
        PreemptionMode::Auto,
        PreemptionMode::Recompute,
        PreemptionMode::Swap,
    ];

    /// The name the Python API uses (`preemption_mode=`); `None` for `Auto`.
    pub fn as_str(self) -> Option<&'static str> {
        match self {
            PreemptionMode::Auto => None,
            PreemptionMode::Recompute => Some("recompute"),
            PreemptionMode::Swap => Some("swap"),
        }
    }

    pub fn parse(s: Option<&str>) -> Result<Self> {
        match s {
            None => Ok(PreemptionMode::Auto),
            Some(s) => parse_name("preemption_mode", s, &Self::ALL[1..], |v| {
                v.as_str().expect("only Auto has no name")
            }),
        }
    }
}

/// Defaults of the public knobs, one place for Rust, the bindings and Python (`_core.DEFAULTS`
/// is built from these; `EngineArgs` reads it). The cache's own are `kv::defaults`'.
pub mod defaults {
    pub use crate::kv::defaults::{BLOCK_SIZE, ENABLE_PREFIX_CACHING, WATERMARK};
    pub const MAX_NUM_SEQS: usize = 256;
    pub const MAX_MODEL_LEN: usize = 2048;
    pub const LONG_PREFILL_TOKEN_THRESHOLD: usize = 0;
    pub const NUM_LOOKAHEAD_SLOTS: usize = 0;
    pub const DELAY_FACTOR: f64 = 0.0;
    /// `max_num_batched_tokens` of the chunking strategies when not given (vLLM V1's).
    pub const CHUNKED_BATCHED_TOKENS: usize = 8192;
    /// Least `max_num_batched_tokens` of `prefill_first` when not given.
    pub const PREFILL_FIRST_MIN_BATCHED_TOKENS: usize = 2048;
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
    /// Most distinct LoRA adapters one step holds (0 = LoRA off: requests carry no adapter).
    pub max_loras: usize,
    /// Speculative decoding with the n-gram proposer (`features/spec/`); `None` = off.
    pub speculative: Option<NgramConfig>,
}

impl SchedulerConfig {
    /// The budget `max_num_batched_tokens=None` stands for: `prefill_first` must fit a whole
    /// prompt of `max_model_len`, the chunking strategies take V1's default.
    pub fn default_batched_tokens(strategy: Strategy, max_model_len: usize) -> usize {
        match strategy {
            Strategy::PrefillFirst => max_model_len.max(defaults::PREFILL_FIRST_MIN_BATCHED_TOKENS),
            Strategy::ChunkedPrefill | Strategy::Unified => defaults::CHUNKED_BATCHED_TOKENS,
        }
    }

    /// `max_num_batched_tokens` 0 (not given) becomes the strategy's default.
    pub fn resolve_budget(&mut self) {
        if self.max_num_batched_tokens == 0 {
            self.max_num_batched_tokens =
                Self::default_batched_tokens(self.strategy, self.max_model_len);
        }
    }

    /// The knobs' rules, each error naming the knob and the value given (the engine's
    /// `EngineArgs.validate` asks these through `_core.check_scheduler_config`).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be >= 1, got 0".into());
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be >= 1, got 0".into());
        }
        if self.max_model_len < 2 {
            return bad(format!(
                "max_model_len must be >= 2 (a prompt token and a generated one), got {}",
                self.max_model_len
            ));
        }
        if !(self.delay_factor >= 0.0 && self.delay_factor.is_finite()) {
            return bad(format!(
                "delay_factor must be a finite number >= 0, got {}",
                self.delay_factor
            ));
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
