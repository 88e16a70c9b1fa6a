//! One step's budget: the tokens it may still compute and how a sequence's tokens may be cut
//! to fit. The strategy hands it down to every phase (running walk, swap-in, admission);
//! admission conditions read it (see `admission::conditions`).
use crate::scheduler::features::lora::LoraTally;
use crate::scheduler::Strategy;

/// Whether a request's tokens may be cut to the remaining budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cut {
    /// Chunking strategies: each sequence takes what budget (and the long-prefill threshold)
    /// allows.
    Split,
    /// `prefill_first`: all of a sequence's tokens this step, or none of them.
    Whole,
}

impl Cut {
    /// Tokens a sequence that wants `want` takes from `left` with at most `cap` per sequence:
    /// what fits under `Split`, all or nothing (0) under `Whole`.
    #[inline]
    pub(super) fn take(self, want: usize, left: usize, cap: usize) -> usize {
        match self {
            Cut::Split => want.min(left).min(cap),
            Cut::Whole if want <= left => want,
            Cut::Whole => 0,
        }
    }
}

/// What the step may still take.
///
/// Room for what comes next: a per-step tally that an admission condition reads (e.g. the
/// adapters this step holds, for "a step holds at most N adapters") is a field here, counted
/// in [`Budget::admitted`] (every admission and swap-in passes there) and seeded from the
/// running requests where the step starts (`Scheduler::schedule`).
#[derive(Debug, Clone)]
pub(in crate::scheduler) struct Budget {
    /// Tokens this step may still compute (`max_num_batched_tokens` at the start).
    pub(super) tokens: usize,
    pub(super) cut: Cut,
    /// The adapters this step holds (`max_loras`), seeded from `running`.
    pub(in crate::scheduler) loras: LoraTally,
}

impl Budget {
    pub(super) fn new(strategy: Strategy, max_num_batched_tokens: usize) -> Self {
        Budget {
            tokens: max_num_batched_tokens,
            cut: match strategy {
                Strategy::PrefillFirst => Cut::Whole,
                Strategy::ChunkedPrefill | Strategy::Unified => Cut::Split,
            },
            loras: LoraTally::default(),
        }
    }

    /// A request just joined `running` computing `tokens` this step.
    #[inline]
    pub(super) fn admitted(&mut self, tokens: usize) {
        self.tokens -= tokens;
    }
}
