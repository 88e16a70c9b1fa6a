//! Admission: how a request gets into `running`, from `waiting` (a new or recompute-preempted
//! request) or from `swapped` (a swapped-out group coming back), under all three strategies.
//!
//! One ladder decides every candidate, in this order:
//! 1. [`Scheduler::gates`], the step's gates: budget left, queue order (the swapped-queue
//!    guard: waiting requests wait while groups are swapped out, see
//!    `Queues::admission_open_for`), the features' [`conditions`], seats (`max_num_seqs`);
//! 2. the pool: NEVER (finishes as ignored), LATER (not enough free blocks now) or OK, asked of
//!    the manager by `try_admit` (new sequences: prefix lookup, allocation keeping the
//!    watermark) or `try_swap_in` (the group's blocks plus its next tokens' slots).
//!
//! Its answer is a [`Verdict`], and one walk ([`Scheduler::admit_from`]) acts on it for both
//! queues. The `priority` probe that preempts running requests to make room for a waiting one
//! (`preemption::preempt_for_waiting`) reads the same gates.
//!
//! Room for what comes next: a feature adds an admission condition ("this request waits for
//! its grammar", "a step holds at most N adapters") in [`conditions`] only; every strategy,
//! swap-ins and the probe go through it.
use crate::error::Result;
use crate::kv::{AllocStatus, PrefixHit};

use super::budget::{Budget, Cut};
use super::plan::sync_mirror;
use crate::scheduler::features::connector::RemoteKvs;
use crate::scheduler::output::StepOutput;
use crate::scheduler::state::queue::{Queue, Queues};
use crate::scheduler::state::request::{GrammarState, Request, RequestStatus};
use crate::scheduler::state::store::RequestStore;
use crate::scheduler::Scheduler;

/// Where a candidate stands this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::scheduler) enum Verdict {
    /// Admitted (`try_admit` / `try_swap_in` have moved it to `running`).
    Ok,
    /// Not now, and nobody behind it either this step (queue order is kept).
    Later(Short),
    /// Not now, but it keeps its place and does not hold back those behind it (only a
    /// feature condition answers this: e.g. its adapter would be one too many this step, or
    /// its grammar is still compiling).
    Wait,
    /// Can never run: finishes as ignored, with the reason.
    Never(String),
}

/// What a `Later` candidate is short of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::scheduler) enum Short {
    /// Tokens of the step's budget.
    Budget,
    /// Its turn: swapped-out groups come back first.
    Order,
    /// A feature condition (see [`conditions`]).
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "for feature conditions to come")
    )]
    Condition,
    /// Seats: `max_num_seqs` running sequences.
    Seats,
    /// Free device blocks.
    Blocks,
}

/// The admission conditions that features add. Every admission path consults this one
/// function for every candidate (a waiting request or a swapped group, `from`), after the
/// budget and queue-order gates and before seats and blocks:
/// - `Some(Verdict::Wait)`: the request waits, keeping its place, and those behind it may go
///   (e.g. its grammar is still being compiled: `req.extras`);
/// - `Some(Verdict::Later(Short::Condition))`: nothing more joins this step (strict order);
/// - `None`: on to seats and blocks.
///
/// Per-step limits read the tallies of `budget`. Today: a step holds at most `max_loras`
/// adapters — a request whose adapter is not among the step's and would be one too many
/// waits (`features/lora.rs`).
/// The `priority` probe preempts nobody for a request a condition holds back.
#[inline]
pub(super) fn conditions(req: &Request, from: Queue, budget: &Budget) -> Option<Verdict> {
    let _ = from;
    // KV connector: its prefix is loading (`features/connector.rs`).
    if req.status == RequestStatus::WaitingForRemoteKvs {
        return Some(Verdict::Wait);
    }
    // Structured output: nothing to sample with until the grammar is compiled.
    if req.extras.grammar == GrammarState::Compiling {
        return Some(Verdict::Wait);
    }
    #[cfg(test)]
    if let Some(verdict) = &req.extras.condition {
        return Some(verdict.clone());
    }
    if !budget.loras.admits(req.extras.lora_id) {
        return Some(Verdict::Wait);
    }
    None
}

/// `delay_factor`: admit only once the oldest waiting request has waited `delay_factor` x the
/// last prefill step's latency, or when nothing runs.
#[derive(Debug, Default)]
pub(in crate::scheduler) struct AdmissionDelay {
    prev_prompt: bool,
    prev_time: f64,
    last_prompt_latency: f64,
}

impl AdmissionDelay {
    /// Whether this step (at `now`) may admit.
    pub(super) fn passed(
        &mut self,
        now: f64,
        delay_factor: f64,
        queues: &Queues,
        store: &RequestStore,
    ) -> bool {
        if self.prev_prompt {
            self.last_prompt_latency = now - self.prev_time;
        }
        self.prev_time = now;
        self.prev_prompt = false;
        if delay_factor <= 0.0 || queues.waiting.is_empty() {
            return true;
        }
        let earliest = queues
            .waiting
            .iter()
            .map(|&h| store.get(h).arrival_time)
            .fold(f64::INFINITY, f64::min);
        now - earliest > delay_factor * self.last_prompt_latency || queues.running.is_empty()
    }

    /// Notes whether the step just scheduled admitted anything (a prefill step).
    pub(super) fn step_done(&mut self, admitted: bool) {
        self.prev_prompt = admitted;
    }
}

impl Scheduler {
    /// The step's gates for candidate `h` from queue `from`, in order: budget, queue order,
    /// feature conditions, seats. `None` when all pass (the pool decides next).
    pub(super) fn gates(&self, h: u32, from: Queue, budget: &Budget) -> Option<Verdict> {
        if budget.tokens == 0 {
            return Some(Verdict::Later(Short::Budget));
        }
        if from == Queue::Waiting && !self.queues.admission_open_for(h, &self.store) {
            return Some(Verdict::Later(Short::Order));
        }
        let req = self.store.get(h);
        if let Some(verdict) = conditions(req, from, budget) {
            return Some(verdict);
        }
        let seats = self.queues.running_seats + req.seats();
        if seats > self.cfg.max_num_seqs {
            return Some(Verdict::Later(Short::Seats));
        }
        // A KV connector's loading and loaded requests hold their seats until admitted. One
        // short only of those seats steps aside while a loaded one waits (it may be behind:
        // `priority` ranks a newcomer first, and nothing else would free them).
        if self.kv.is_attached() && seats + self.kv.reserved_seats(h) > self.cfg.max_num_seqs {
            return Some(match self.kv.has_promoted_besides(h) {
                true => Verdict::Wait,
                false => Verdict::Later(Short::Seats),
            });
        }
        None
    }

    /// Brings candidates from `from` into the tail of `running`, in queue order, while the
    /// ladder says OK; a NEVER finishes as ignored, a `Wait` is stepped over, a LATER ends
    /// the walk. Each admitted candidate computes its first tokens in this very step.
    /// Returns whether any was admitted.
    pub(super) fn admit_from(
        &mut self,
        from: Queue,
        budget: &mut Budget,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let mut any = false;
        let mut at = 0;
        while let Some(h) = self.queues.get(from, at) {
            let verdict = match self.gates(h, from, budget) {
                Some(verdict) => verdict,
                None => match from {
                    Queue::Waiting => self.try_admit(h, at, budget, out)?,
                    Queue::Swapped => self.try_swap_in(h, at, budget, out)?,
                },
            };
            match verdict {
                Verdict::Ok => {
                    any = true;
                    budget.loras.hold(self.store.get(h).extras.lora_id);
                }
                Verdict::Later(_) => break,
                Verdict::Wait => at += 1,
                Verdict::Never(reason) => {
                    self.queues.remove_at(from, at);
                    self.finish_ignored(h, reason, out)?;
                }
            }
        }
        Ok(any)
    }

    /// The pool's answer for waiting request `h` (position `at`): NEVER check, prefix lookup,
    /// allocation of its first chunk (keeping the watermark); when it fits, its tokens are
    /// recorded and it joins `running`.
    fn try_admit(
        &mut self,
        h: u32,
        at: usize,
        budget: &mut Budget,
        out: &mut StepOutput,
    ) -> Result<Verdict> {
        if let Some(reason) = self.group_never_fits(h) {
            return Ok(Verdict::Never(reason));
        }
        let la = self.cfg.num_lookahead_slots;
        let cap = self.chunk_cap();
        let caching = self.caching();
        let req = self.store.get(h);
        let leader = req.leader();
        let (target, seq_id) = (req.leader_target(), req.seqs[leader].id);
        let hit = if caching {
            self.mgr
                .lookup_prefix(&req.seqs[leader].tokens[..target], req.extra_key)
        } else {
            PrefixHit::default()
        };
        // A KV connector that holds the prefix past the hit loads it: asynchronously the
        // request is parked meanwhile; synchronously its tokens count as computed now.
        let (hit, sync) = match self.kv.is_attached() {
            false => (hit, None),
            true => match self.match_remote_kvs(h, hit)? {
                RemoteKvs::None(hit) => (hit, None),
                RemoteKvs::Parked => return Ok(Verdict::Wait),
                RemoteKvs::Sync {
                    hit,
                    hashes,
                    external,
                } => (hit, Some((hashes, external))),
            },
        };
        let computed = hit.num_cached_tokens + sync.as_ref().map_or(0, |s| s.1);
        let take = budget.cut.take(target - computed, budget.tokens, cap);
        if take == 0 {
            return Ok(Verdict::Later(Short::Budget));
        }
        if !self
            .mgr
            .allocate_owned(seq_id, hit, computed + take + la, true)?
        {
            return Ok(Verdict::Later(Short::Blocks));
        }
        if let Some((hashes, external)) = sync {
            self.start_sync_load(h, &hashes, computed, external)?;
        }
        let req = self.store.get_mut(h);
        let s = &mut req.seqs[leader];
        sync_mirror(&self.mgr, s)?;
        s.num_computed = computed;
        s.tail_shared = false;
        if !req.admitted_once {
            req.admitted_once = true;
            req.num_cached_tokens = computed;
            let external = &mut req.extras.num_external_tokens;
            *external = (*external).min(computed);
        }
        self.planner.plan_one(leader, take);
        self.apply_plan(h, out)?;
        budget.admitted(take);
        self.queues
            .start_running(Queue::Waiting, at, &mut self.store);
        if self.kv.is_attached() {
            self.kv.unstage(h);
        }
        Ok(Verdict::Ok)
    }

    /// The pool's answer for swapped group `h` (position `at`): it comes back only when the
    /// pool holds its blocks *and* the slots of the tokens it computes in this very step
    /// (vLLM V0's `can_swap_in` with lookahead), else it would be swapped out again next step
    /// without having advanced. A group that can never fit again is NEVER.
    fn try_swap_in(
        &mut self,
        h: u32,
        at: usize,
        budget: &mut Budget,
        out: &mut StepOutput,
    ) -> Result<Verdict> {
        let cut = budget.cut;
        self.planner.group_of(self.store.get(h));
        let keep_watermark = !self.queues.running.is_empty();
        let (mut tokens, mut needed) = self.plan_request(h, budget.tokens, cut);
        let mut status = self.swap_in_status(tokens, needed, keep_watermark);
        if status != AllocStatus::Ok && cut == Cut::Split && tokens > 1 {
            // A group swapped out mid-prompt may still fit with a one-token chunk.
            (tokens, needed) = self.plan_request(h, 1, cut);
            status = self.swap_in_status(tokens, needed, keep_watermark);
        }
        if tokens == 0 {
            // `Whole` and the budget cannot take its tokens: it waits, keeping its place.
            return Ok(Verdict::Later(Short::Budget));
        }
        match status {
            AllocStatus::Later => return Ok(Verdict::Later(Short::Blocks)),
            AllocStatus::Never => {
                return Ok(Verdict::Never(format!(
                    "swapped-out group needs more KV blocks than the device pool has ({} \
                     blocks) to compute its next tokens",
                    self.mgr.num_device_blocks()
                )))
            }
            AllocStatus::Ok => {}
        }
        // (host, device) pairs.
        let pairs = self.mgr.swap_in(&self.planner.group)?;
        StepOutput::push_pairs(&mut out.blocks_to_swap_in, pairs);
        for s in self.store.get_mut(h).active_seqs_mut() {
            sync_mirror(&self.mgr, s)?;
        }
        self.queues
            .start_running(Queue::Swapped, at, &mut self.store);
        // The plan made over the host tables holds for the device tables (same shape and
        // sharing), and the blocks it needs were counted above.
        self.apply_plan(h, out)?;
        budget.admitted(tokens);
        Ok(Verdict::Ok)
    }

    /// Swap-in verdict for the group in `planner.group` that would then compute `tokens`
    /// needing `needed` more blocks.
    fn swap_in_status(&self, tokens: usize, needed: usize, keep_watermark: bool) -> AllocStatus {
        if tokens == 0 {
            return AllocStatus::Later;
        }
        self.mgr
            .can_swap_in_and_grow(&self.planner.group, needed, keep_watermark)
    }

    /// Reason a waiting request can never run, if any: its sequences together (sharing the
    /// full blocks of the prompt, each with its own tail) need more blocks than the pool.
    fn group_never_fits(&self, h: u32) -> Option<String> {
        let req = self.store.get(h);
        let bs = self.mgr.block_size();
        let la = self.cfg.num_lookahead_slots;
        let slots = if req.needs_fork() {
            let shared = req.prompt_len / bs;
            let own: usize = req
                .seqs
                .iter()
                .filter(|s| !s.is_finished())
                .map(|s| (s.tokens.len() + la).div_ceil(bs) - shared)
                .sum();
            (shared + own) * bs
        } else {
            req.seqs[req.leader()].tokens.len() + la
        };
        (self.mgr.can_allocate(slots) == AllocStatus::Never).then(|| {
            format!(
                "needs {} KV blocks of {bs} tokens for its {} sequences, more than {}",
                slots.div_ceil(bs),
                req.num_unfinished,
                self.pool_limit()
            )
        })
    }
}
