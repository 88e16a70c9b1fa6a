//! The scheduler (docs/ARCHITECTURE.md §2): request state, the `waiting` / `running` /
//! `swapped` queues, the per-step budget, the three strategies, preemption and stop rules.
//!
//! One step is `schedule(now)` (decides which tokens of which sequences are computed, moves
//! blocks, returns a [`StepOutput`]) followed by `update_from_output` (appends the sampled
//! tokens, applies the stop rules, frees what finished), or by `discard_step` when the step
//! could not be computed.
//!
//! # Who owns what
//! [`Scheduler`] is a composition; each part owns its state and the code that changes it. The
//! folders follow a step's phases.
//!
//! `state/` — what lives between steps:
//! - `state/store.rs` — `RequestStore`: the slab of request slots (generation + [`Request`]),
//!   the id -> slot map, sequence ids and insertion order;
//! - `state/request.rs` — [`Request`], [`Sequence`], [`RequestExtras`]: per-request and
//!   per-sequence state, hot fields first;
//! - `state/queue.rs` — `Queues`: `waiting` / `running` / `swapped`, the seats `running`
//!   takes, the requests ignored at the door, this step's preempted ones; rank order and the
//!   swapped-queue guard;
//! - `state/step.rs` — `StepLedger`: the latest step, whether it is open, its samples.
//!
//! `schedule/` — deciding a step (`schedule(now)`, in `schedule/mod.rs`):
//! - `schedule/strategies.rs` — one planner per strategy (`unified`, `prefill_first`,
//!   `chunked_prefill`): the order of the phases below;
//! - `schedule/running.rs` — the walk over `running` with tail preemption;
//! - `schedule/decode.rs` — the steady-decode fast path (`fast_decode_run`: rows written in
//!   place, `DecodeRun`) and its batched prefix-cache registrations (`DecodeBatch`);
//! - `schedule/plan.rs` — `Planner`: one request's share of the step, and carrying it out
//!   (appends, CoW, registration, the n > 1 fork, samples);
//! - `schedule/admission.rs` — the one admission ladder (gates, feature conditions, the
//!   pool's NEVER / LATER / OK) and the walk that admits from `waiting` and swaps in from
//!   `swapped`; `AdmissionDelay` (`delay_factor`);
//! - `schedule/preemption.rs` — swap or recompute, the one reset to recompute, the
//!   `priority` probe;
//! - `schedule/budget.rs` — `Budget`: what the step may still take (tokens, how to cut
//!   them).
//!
//! `output/` — what a step hands out:
//! - `output/step_output.rs` — [`StepOutput`] (flat arrays), [`StepExtras`], the lazy
//!   tables, [`FinishedSeq`];
//! - `output/record.rs` — `Recorder`: rows of the general path, outputs' buffers, the lazy
//!   tables and per-token arrays (and their snapshots).
//!
//! `apply/` — applying a computed step, or taking it back:
//! - `apply/update.rs` — `update_from_output`, one token per sample; `apply/spec_update.rs`
//!   — `update_from_output_runs`, a run per sample (speculative decoding);
//! - `apply/stop.rs` — the stop rules ([`StopParams`], `cut_run`) and `run_stop_cuts`;
//! - `apply/rollback.rs` — `discard_step`.
//!
//! `features/` — what goes beyond the core, through the seams below:
//! - `features/lora.rs` — a step holds at most `max_loras` adapters; each row's adapter;
//! - `features/grammar.rs` — structured output: a grammar compiled (`grammar_ready`), the
//!   step's constrained samples;
//! - `features/connector.rs` — a KV connector (`crate::connector`): requests parked in
//!   `WAITING_FOR_REMOTE_KVS` while their prefix loads, blocks held while they are saved;
//! - `features/spec/` — speculative decoding: the drafts (`propose.rs`: the n-gram proposer
//!   of `crate::spec`, or drafts set from outside), their fast path (`fast_path.rs`), their
//!   columns in the output (`record.rs`).
//!
//! Beside them: `intake.rs` — `add_request` / `abort_request` and the request rules
//! (`validate_request`, the one owner of what a request may ask); `config.rs` —
//! [`SchedulerConfig`], the modes and `defaults`; `invariants.rs` — `check_invariants`;
//! `stats.rs` — counters and the stats snapshot; `tests/` — the unit tests.
//!
//! Phase code that walks many requests takes the parts it touches rather than the whole
//! scheduler: the walk over `running` hands both fast paths (`fast_decode_run`,
//! `spec_fast_run`) the store, the manager and the registration batch (and the drafts), and
//! the updates destructure the scheduler; what a feature adds reaches them only through
//! their parameters.
//!
//! The KV-cache manager (`crate::kv`) owns blocks, tables and the prefix cache; the
//! scheduler asks it through its public methods and reads the cache's facts (block size,
//! pool size, whether prefix caching is on) from it. Each sequence mirrors its device table
//! (`MirrorTable`) so the hot path computes slots locally; the manager is only called when a
//! sequence needs a new block, a CoW copy, or fills a block to register.
//!
//! # Hot path
//! Requests live in a slab addressed by `u32` handles (no hashing after `add_request`); a
//! slot's generation and its request's hot fields share a cache line, and a single-sequence
//! request keeps its sequence inline right after them ([`Seqs`]): its whole decode state is
//! the slot's first 128 bytes, found from the handle alone (`repr(C)` layouts, unit tests
//! `hot_fields_share_a_cache_line` and `slot_generation_and_hot_request_fields_share_a_line`).
//! Steady decodes take the fast path of `schedule/decode.rs`, which writes their rows in
//! place.
//!
//! # Room for what comes next
//! - Per-request state of a feature (draft tokens, a grammar state, an adapter id):
//!   [`RequestExtras`] in [`Request`], filled from [`RequestParams`] in one place.
//! - Per-row step data for the model runner: [`StepExtras`] in [`StepOutput`].
//! - An admission condition ("waits for its grammar, keeping its place", "a step holds at
//!   most N adapters", `features/lora.rs`): `schedule::admission::conditions`, the one
//!   function every strategy's admission, every swap-in and the `priority` probe consult;
//!   per-step tallies live in `Budget`.
mod apply;
mod config;
mod features;
mod intake;
mod invariants;
mod output;
mod schedule;
mod state;
mod stats;

use crate::error::{Error, Result};
use crate::kv::{CacheConfig, KvCacheManager};

pub use apply::stop::{FinishReason, StopCuts, StopParams};
pub use config::{defaults, Policy, PreemptionMode, SchedulerConfig, Strategy};
pub use features::spec::DraftProposals;
pub use intake::{request_repr, too_many_seqs};
pub use output::{FinishedSeq, LazyTables, SharedTables, StepExtras, StepOutput, TableRow};
pub use state::request::{
    GrammarState, MirrorTable, Request, RequestExtras, RequestParams, RequestStatus, Seqs, Sequence,
};
pub use stats::{SchedulerCounters, SchedulerStats};

use features::connector::ConnectorState;
use features::spec::SpecState;
use output::record::Recorder;
use schedule::admission::AdmissionDelay;
use schedule::decode::DecodeBatch;
use schedule::plan::Planner;
use state::queue::Queues;
use state::step::StepLedger;
use state::store::RequestStore;

pub struct Scheduler {
    cfg: SchedulerConfig,
    mgr: KvCacheManager,
    store: RequestStore,
    queues: Queues,
    planner: Planner,
    batch: DecodeBatch,
    recorder: Recorder,
    ledger: StepLedger,
    delay: AdmissionDelay,
    counters: SchedulerCounters,
    spec: SpecState,
    kv: ConnectorState,
}

impl Scheduler {
    pub fn new(cache: CacheConfig, mut cfg: SchedulerConfig) -> Result<Self> {
        cfg.resolve_budget();
        Self::check_config(&cache, &cfg)?;
        let mgr = KvCacheManager::new(cache)?;
        Ok(Scheduler {
            queues: Queues::new(cfg.policy),
            cfg,
            mgr,
            store: RequestStore::default(),
            planner: Planner::default(),
            batch: DecodeBatch::default(),
            recorder: Recorder::default(),
            ledger: StepLedger::default(),
            delay: AdmissionDelay::default(),
            counters: SchedulerCounters::default(),
            spec: SpecState::default(),
            kv: ConnectorState::default(),
        })
    }

    /// The configuration rules `new` applies (the scheduler's, then the cache's), without
    /// building anything; `cfg`'s budget as `resolve_budget` leaves it.
    pub fn check_config(cache: &CacheConfig, cfg: &SchedulerConfig) -> Result<()> {
        cfg.validate()?;
        cache.validate()
    }

    /// The fewest device blocks (`cache`'s block size and watermark) with which the longest
    /// sequence `cfg` can hold (`max_seq_len`) is ever admitted; a smaller cache refuses some
    /// request the configuration allows, whatever happens. Start-up sizing asks this.
    pub fn min_device_blocks(cache: &CacheConfig, cfg: &SchedulerConfig) -> usize {
        cache.min_device_blocks(cfg.max_seq_len())
    }

    // ---- accessors ----------------------------------------------------------------------

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn manager(&self) -> &KvCacheManager {
        &self.mgr
    }

    /// Lays out the model's KV groups (`KvCacheManager::set_groups`: one window or `None`
    /// per layer group), before any request is added and without a KV connector.
    pub fn set_kv_groups(&mut self, windows: Vec<Option<usize>>) -> Result<()> {
        if self.has_unfinished_requests() || self.kv.is_attached() {
            return Err(Error::InvalidState(
                "kv groups are set before any request is added and without a KV connector".into(),
            ));
        }
        self.mgr.set_groups(windows)?;
        self.mgr.set_max_chunk(Self::max_chunk(&self.cfg));
        Ok(())
    }

    /// The most tokens one step adds to a sequence's table: a prefill chunk (with the
    /// lookahead slots), or a whole prompt under `prefill_first`, which never splits one.
    fn max_chunk(cfg: &SchedulerConfig) -> usize {
        match cfg.strategy {
            Strategy::PrefillFirst => usize::MAX,
            _ => cfg.max_num_batched_tokens + cfg.num_lookahead_slots,
        }
    }

    /// `min_device_blocks` for a cache of the KV groups `windows` (`set_kv_groups`): the
    /// longest sequence's blocks in every group, a window group's bounded by its window and
    /// the chunk (`kv::max_blocks_held`), plus the watermark's share.
    pub fn min_device_blocks_grouped(
        cache: &CacheConfig,
        cfg: &SchedulerConfig,
        windows: &[Option<usize>],
    ) -> usize {
        let needed = crate::kv::max_blocks_held(
            windows,
            Self::max_chunk(cfg),
            cfg.max_seq_len(),
            cache.block_size,
        );
        cache.min_pool_for(needed)
    }

    /// The prefix cache's KV-event log, which the engine turns on and drains once per step.
    pub fn kv_events_mut(&mut self) -> &mut crate::kv::KvEventLog {
        self.mgr.kv_events_mut()
    }

    pub fn block_size(&self) -> usize {
        self.mgr.block_size()
    }

    pub fn num_waiting(&self) -> usize {
        self.queues.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.queues.running.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.queues.swapped.len()
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.store.is_empty()
    }

    pub fn current_step(&self) -> u64 {
        self.ledger.step
    }

    /// Id of the request an output named by (slot, generation); `None` once the slot has
    /// been given to another request.
    pub fn resolve_id(&self, handle: u32, gen: u32) -> Option<&str> {
        self.store.resolve(handle, gen)
    }

    /// Generation of a request slot (bumped each time the slot is reused).
    pub fn slot_generation(&self, handle: u32) -> u32 {
        self.store.gen(handle)
    }

    /// Slot of a live request (the bindings cache per-slot Python strings).
    pub fn handle_of(&self, request_id: &str) -> Option<u32> {
        self.store.handle_of(request_id)
    }

    pub fn request(&self, request_id: &str) -> Option<&Request> {
        self.store.handle_of(request_id).map(|h| self.store.get(h))
    }

    pub fn request_status(&self, request_id: &str) -> Option<RequestStatus> {
        self.request(request_id).map(|r| r.status)
    }

    pub fn waiting_ids(&self) -> Vec<&str> {
        Queues::ids(&self.queues.waiting, &self.store)
    }

    pub fn running_ids(&self) -> Vec<&str> {
        Queues::ids(&self.queues.running, &self.store)
    }

    pub fn swapped_ids(&self) -> Vec<&str> {
        Queues::ids(&self.queues.swapped, &self.store)
    }

    /// Whether the manager registers full blocks in its prefix cache.
    #[inline]
    fn caching(&self) -> bool {
        self.mgr.config().enable_prefix_caching
    }

    /// The end of a "can never fit" reason: the pool's size and watermark.
    fn pool_limit(&self) -> String {
        format!(
            "the cache can ever give ({} blocks, watermark {})",
            self.mgr.num_device_blocks(),
            self.mgr.watermark_blocks()
        )
    }

    /// Finishes request `h` (out of every queue) as ignored, reported in `out`.
    fn finish_ignored(&mut self, h: u32, reason: String, out: &mut StepOutput) -> Result<()> {
        self.store.get_mut(h).status = RequestStatus::FinishedIgnored;
        let req = self.release(h)?;
        out.finished.push((req.id, reason));
        self.counters.num_ignored += 1;
        Ok(())
    }

    /// Drops a request that left every queue, freeing whatever blocks it still holds.
    fn release(&mut self, h: u32) -> Result<Request> {
        self.recorder.materialize_pending(&self.store);
        // A KV connector may keep a sequence's blocks while it loads or saves them.
        let held = match self.kv.is_attached() {
            true => {
                self.kv.unstage(h);
                self.kv.hold(self.store.get(h), &self.mgr)
            }
            false => None,
        };
        let req = self.store.take(h);
        for s in &req.seqs {
            if Some(s.id) != held && self.mgr.contains(s.id) {
                self.mgr.free(s.id)?;
            }
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests;
