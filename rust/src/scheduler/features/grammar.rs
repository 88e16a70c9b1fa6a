//! Structured output in the scheduler: a request added with `structured_output` waits in
//! `waiting` while its grammar compiles (admission steps over it, see
//! `schedule::admission::conditions`), becomes schedulable once the engine reports the grammar
//! compiled, and its samples are named in each step's output so the sampler masks them. A
//! grammar that fails to compile is the engine's to report: it aborts the request
//! (`abort_request`), which frees it like any other.
use crate::error::{Error, Result};

use crate::scheduler::output::StepOutput;
use crate::scheduler::state::request::GrammarState;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Marks the grammar of `request_id` compiled: the request is admitted from the next
    /// `schedule()` on. Returns false for unknown and finished ids (e.g. aborted while its
    /// grammar compiled) and for a grammar already marked; an InvalidArgument error for a
    /// request added without `structured_output`.
    pub fn grammar_ready(&mut self, request_id: &str) -> Result<bool> {
        let Some(h) = self.store.handle_of(request_id) else {
            return Ok(false);
        };
        let req = self.store.get_mut(h);
        match req.extras.grammar {
            GrammarState::Compiling if !req.status.is_finished() => {
                req.extras.grammar = GrammarState::Ready;
                Ok(true)
            }
            GrammarState::Compiling | GrammarState::Ready => Ok(false),
            GrammarState::Unconstrained => Err(Error::InvalidArgument(format!(
                "request {request_id:?} was added without structured_output: it has no grammar"
            ))),
        }
    }

    /// [G] indices (into the step's K samples) of the samples drawn under a grammar, in
    /// sample order. Read from the requests' slots when asked (the step records nothing for
    /// it, so unconstrained steps and the decode fast path pay nothing); a sample whose
    /// request has since left its slot is not listed.
    pub fn structured_samples(&self, out: &StepOutput) -> Vec<i64> {
        let mut v = Vec::new();
        for (k, (&h, &gen)) in out.sample_handles.iter().zip(&out.sample_gens).enumerate() {
            if !self.store.is_live(h, gen) {
                continue;
            }
            if self.store.get(h).extras.grammar == GrammarState::Ready {
                v.push(k as i64);
            }
        }
        v
    }
}
