//! The scheduler (SPEC §4, ARCHITECTURE §2): request state, the `waiting` / `running` /
//! `swapped` queues, the per-step budget, the three strategies, preemption and stop rules.
//!
//! One step is `schedule(now)` (decides which tokens of which sequences are computed, moves
//! blocks, returns a [`StepOutput`]) followed by `update_from_output` (appends the sampled
//! tokens, applies the stop rules, frees what finished).
//!
//! Hot-path choices: requests live in a slab addressed by `u32` handles (no hashing after
//! `add_request`); every sequence mirrors its block table so slots are computed locally; the
//! manager is only called when a sequence needs a new block, a CoW copy, or fills a block
//! that must be registered in the prefix cache.
mod chunked_prefill;
mod config;
mod output;
mod plan;
mod preemption;
mod prefill_first;
mod queue;
mod request;
mod unified;

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId, TokenId};
use crate::kv::{AllocStatus, CacheConfig, CacheStats, KvCacheManager};

pub use config::{defaults, Policy, PreemptionMode, SchedulerConfig, Strategy};
pub use output::{FinishedSeq, LazyTables, SharedTables, StepOutput, TableRow};
pub use request::{
    FinishReason, MirrorTable, Request, RequestParams, RequestStatus, Sequence, StopParams,
};

use plan::{DecodeRow, PlanItem};

/// Freed request slots are reused only once this many wait in line, so the ids of a recent
/// step's output stay resolvable (outputs name requests by slot + generation).
const RECYCLE_AFTER: usize = 4096;

/// `repr(C)`, cache-line aligned: the generation and the request's hot fields (see
/// [`Request`]) share the slot's first line.
#[derive(Debug)]
#[repr(C, align(64))]
struct Slot {
    gen: u32,
    req: Option<Request>,
    /// Id of the current (or last) occupant; kept after it leaves so old outputs resolve it.
    id: String,
}

/// Counters beyond the queue lengths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    pub num_steps: u64,
    pub num_preemptions_recompute: u64,
    pub num_preemptions_swap: u64,
    pub num_finished: u64,
    pub num_ignored: u64,
    pub num_aborted: u64,
    pub num_batched_tokens_total: u64,
    /// Steps taken back by `discard_step`.
    pub num_rolled_back_steps: u64,
}

/// Snapshot for `get_stats()`.
#[derive(Debug, Clone)]
pub struct SchedulerStats {
    pub num_waiting: usize,
    pub num_running: usize,
    pub num_swapped: usize,
    pub num_running_seqs: usize,
    pub counters: SchedulerCounters,
    pub cache: CacheStats,
}

/// Where a waiting request stands at admission.
enum Admit {
    Admitted(usize),
    Later,
    NoBudget,
    Never(String),
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    block_size: usize,
    num_device_blocks: usize,
    caching: bool,
    /// Longest sequence allowed (`max_model_len`, or less under `prefill_first`).
    max_seq_len: usize,
    mgr: KvCacheManager,

    slots: Vec<Slot>,
    free_slots: VecDeque<u32>,
    by_id: HashMap<String, u32>,

    waiting: VecDeque<u32>,
    running: Vec<u32>,
    swapped: VecDeque<u32>,
    /// Requests found unservable at `add_request`, reported by the next `schedule()`.
    pending_ignored: Vec<(u32, String)>,
    /// Seats (`max_num_seqs`) taken by `running`: its unfinished sequences.
    running_seats: usize,

    next_seq_id: SeqId,
    next_order: u64,
    step: u64,
    /// The latest output has samples that `update_from_output` has not taken yet.
    awaiting_update: bool,
    /// The latest output was neither applied (`update_from_output`) nor discarded yet.
    step_open: bool,
    /// Slot, generation and sequence index of each sample of the latest output (copies of
    /// the output's sample columns: three memcpys instead of a zipped gather).
    last_handles: Vec<u32>,
    last_gens: Vec<u32>,
    last_seq_index: Vec<i32>,

    prev_prompt: bool,
    prev_time: f64,
    last_prompt_latency: f64,

    counters: SchedulerCounters,

    // Scratch buffers reused across steps.
    plan: Vec<PlanItem>,
    seq_scratch: Vec<SeqId>,
    preempted_recompute: Vec<u32>,
    preempted_swap: Vec<u32>,
    cow_scratch: Vec<BlockId>,
    decode_rows: Vec<DecodeRow>,
    /// (request slot, num_computed) of fast-path decodes that filled a block, registered in
    /// the prefix cache by `flush_fills` at the same points the rows are flushed.
    pending_fills: Vec<(u32, u32)>,
    finished_scratch: Vec<(u32, u32)>,
    last_sizes: (usize, usize),
    /// Outputs handed back by `recycle`, so steady steps allocate nothing.
    spare_outputs: Vec<StepOutput>,
    /// Block tables of recent outputs not built yet; `materialize_pending` snapshots the ones
    /// still held by a caller before any table changes other than by appending.
    pending_tables: Vec<SharedTables>,
}

impl Scheduler {
    pub fn new(cache: CacheConfig, mut cfg: SchedulerConfig) -> Result<Self> {
        if cfg.max_num_batched_tokens == 0 {
            cfg.max_num_batched_tokens =
                SchedulerConfig::default_batched_tokens(cfg.strategy, cfg.max_model_len);
        }
        cfg.validate()?;
        let block_size = cache.block_size;
        let num_device_blocks = cache.num_device_blocks;
        let caching = cache.enable_prefix_caching;
        let mgr = KvCacheManager::new(cache)?;
        Ok(Scheduler {
            max_seq_len: cfg.max_seq_len(),
            cfg,
            block_size,
            num_device_blocks,
            caching,
            mgr,
            slots: Vec::new(),
            free_slots: VecDeque::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            pending_ignored: Vec::new(),
            running_seats: 0,
            next_seq_id: 0,
            next_order: 0,
            step: 0,
            awaiting_update: false,
            step_open: false,
            last_handles: Vec::new(),
            last_gens: Vec::new(),
            last_seq_index: Vec::new(),
            prev_prompt: false,
            prev_time: 0.0,
            last_prompt_latency: 0.0,
            counters: SchedulerCounters::default(),
            plan: Vec::new(),
            seq_scratch: Vec::new(),
            preempted_recompute: Vec::new(),
            preempted_swap: Vec::new(),
            cow_scratch: Vec::new(),
            decode_rows: Vec::new(),
            pending_fills: Vec::new(),
            finished_scratch: Vec::new(),
            last_sizes: (0, 0),
            spare_outputs: Vec::new(),
            pending_tables: Vec::new(),
        })
    }

    // ---- accessors ----------------------------------------------------------------------

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn manager(&self) -> &KvCacheManager {
        &self.mgr
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.by_id.is_empty()
    }

    pub fn current_step(&self) -> u64 {
        self.step
    }

    fn req(&self, h: u32) -> &Request {
        self.slots[h as usize]
            .req
            .as_ref()
            .expect("queued slot holds a request")
    }

    fn req_mut(&mut self, h: u32) -> &mut Request {
        self.slots[h as usize]
            .req
            .as_mut()
            .expect("queued slot holds a request")
    }

    /// Id of the request an output named by (slot, generation); `None` once the slot has
    /// been given to another request.
    pub fn resolve_id(&self, handle: u32, gen: u32) -> Option<&str> {
        let slot = self.slots.get(handle as usize)?;
        (slot.gen == gen).then_some(slot.id.as_str())
    }

    /// Generation of a request slot (bumped each time the slot is reused).
    pub fn slot_generation(&self, handle: u32) -> u32 {
        self.slots[handle as usize].gen
    }

    /// Slot of a live request (the bindings cache per-slot Python strings).
    pub fn handle_of(&self, request_id: &str) -> Option<u32> {
        self.by_id.get(request_id).copied()
    }

    pub fn request(&self, request_id: &str) -> Option<&Request> {
        self.by_id.get(request_id).map(|&h| self.req(h))
    }

    pub fn request_status(&self, request_id: &str) -> Option<RequestStatus> {
        self.request(request_id).map(|r| r.status)
    }

    pub fn waiting_ids(&self) -> Vec<&str> {
        self.waiting
            .iter()
            .map(|&h| self.req(h).id.as_str())
            .collect()
    }

    pub fn running_ids(&self) -> Vec<&str> {
        self.running
            .iter()
            .map(|&h| self.req(h).id.as_str())
            .collect()
    }

    pub fn swapped_ids(&self) -> Vec<&str> {
        self.swapped
            .iter()
            .map(|&h| self.req(h).id.as_str())
            .collect()
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_waiting: self.waiting.len(),
            num_running: self.running.len(),
            num_swapped: self.swapped.len(),
            num_running_seqs: self.running_seats,
            counters: self.counters,
            cache: self.mgr.stats(),
        }
    }

    // ---- requests -----------------------------------------------------------------------

    /// Queues a request; returns its slot. `n` above `max_num_seqs` is an `InvalidArgument`
    /// error before anything is allocated. Unservable requests (prompt too long, more blocks
    /// than the pool) are accepted and reported as ignored by the next `schedule()`.
    pub fn add_request(&mut self, request_id: &str, params: RequestParams) -> Result<u32> {
        let bad = |m: String| {
            Err(Error::InvalidArgument(format!(
                "request {request_id:?}: {m}"
            )))
        };
        if params.prompt.is_empty() {
            return bad("empty prompt".into());
        }
        if self.by_id.contains_key(request_id) {
            return bad("duplicate request id".into());
        }
        if params.n == 0 {
            return bad("n must be >= 1".into());
        }
        if params.n > self.cfg.max_num_seqs {
            // checked before the n sequences are allocated: a huge n must not abort the process
            return bad(format!(
                "n={} exceeds max_num_seqs={} (the most sequences one request may have)",
                params.n, self.cfg.max_num_seqs
            ));
        }
        if params.stop.max_tokens == 0 {
            return bad("max_tokens must be >= 1".into());
        }
        if params.stop.min_tokens > params.stop.max_tokens {
            return bad(format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                params.stop.min_tokens, params.stop.max_tokens
            ));
        }
        if !params.arrival_time.is_finite() {
            return bad("arrival_time must be finite".into());
        }
        let prompt_len = params.prompt.len();
        // Room for the first outputs up front: appending the first sampled token to a
        // prompt-sized vector would copy the whole prompt.
        let room = params
            .stop
            .max_tokens
            .min(self.cfg.max_model_len.saturating_sub(prompt_len))
            .min(256);
        let mut seqs = Vec::with_capacity(params.n);
        for _ in 0..params.n {
            let mut tokens = Vec::with_capacity(prompt_len + room);
            tokens.extend_from_slice(&params.prompt);
            seqs.push(Sequence {
                id: self.next_seq_id,
                last_token: *tokens.last().expect("prompt is not empty"),
                tokens,
                num_computed: 0,
                table: MirrorTable::default(),
                tail_shared: false,
                finished: None,
            });
            self.next_seq_id += 1;
        }
        let quiet_until = params.stop.quiet_until(prompt_len, self.max_seq_len);
        let req = Request {
            first_seq_id: seqs[0].id,
            id: request_id.to_string(),
            quiet_until,
            prompt_len,
            num_unfinished: params.n,
            seqs,
            forked: false,
            priority: params.priority,
            arrival_time: params.arrival_time,
            order: self.next_order,
            stop: params.stop,
            extra_key: params.extra_key,
            status: RequestStatus::Waiting,
            num_cached_tokens: 0,
            admitted_once: false,
        };
        self.next_order += 1;
        let ignore = self.unservable(&req);
        let h = self.place(req);
        self.by_id.insert(request_id.to_string(), h);
        match ignore {
            Some(reason) => {
                self.req_mut(h).status = RequestStatus::FinishedIgnored;
                self.pending_ignored.push((h, reason));
            }
            None => self.enqueue_waiting(h),
        }
        Ok(h)
    }

    /// Reason a new request can never be served, if any.
    fn unservable(&self, req: &Request) -> Option<String> {
        let p = req.prompt_len;
        if p > self.max_seq_len {
            let limit = if self.max_seq_len < self.cfg.max_model_len {
                format!(
                    "{} = min(max_model_len, max_num_batched_tokens), as prefill_first never \
                     splits a prompt",
                    self.max_seq_len
                )
            } else {
                format!("max_model_len={}", self.max_seq_len)
            };
            return Some(format!("prompt of {p} tokens is longer than {limit}"));
        }
        self.never_fits(p).map(|r| format!("prompt {r}"))
    }

    /// Reason a sequence of `num_tokens` can never fit the device pool.
    fn never_fits(&self, num_tokens: usize) -> Option<String> {
        let slots = num_tokens + self.cfg.num_lookahead_slots;
        (self.mgr.can_allocate(slots) == AllocStatus::Never).then(|| {
            format!(
                "of {num_tokens} tokens needs {} KV blocks of {} tokens, more than the cache can \
                 ever give ({} blocks, watermark {})",
                slots.div_ceil(self.block_size),
                self.block_size,
                self.num_device_blocks,
                self.mgr.watermark_blocks()
            )
        })
    }

    /// Reason a waiting request can never run, if any: its sequences together (sharing the
    /// full blocks of the prompt, each with its own tail) need more blocks than the pool.
    fn group_never_fits(&self, h: u32) -> Option<String> {
        let req = self.req(h);
        let bs = self.block_size;
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
                "needs {} KV blocks of {bs} tokens for its {} sequences, more than the cache can \
                 ever give ({} blocks, watermark {})",
                slots.div_ceil(bs),
                req.num_unfinished,
                self.num_device_blocks,
                self.mgr.watermark_blocks()
            )
        })
    }

    fn place(&mut self, req: Request) -> u32 {
        if self.free_slots.len() > RECYCLE_AFTER {
            let h = self.free_slots.pop_front().expect("non-empty");
            let slot = &mut self.slots[h as usize];
            slot.gen = slot.gen.wrapping_add(1);
            slot.id.clone_from(&req.id);
            slot.req = Some(req);
            h
        } else {
            let h = u32::try_from(self.slots.len()).expect("fewer than 2^32 request slots");
            self.slots.push(Slot {
                id: req.id.clone(),
                req: Some(req),
                gen: 0,
            });
            h
        }
    }

    /// Drops a request that left every queue, freeing whatever blocks it still holds.
    fn release(&mut self, h: u32) -> Result<Request> {
        self.materialize_pending();
        let req = self.slots[h as usize]
            .req
            .take()
            .expect("released slot holds a request");
        for s in &req.seqs {
            if self.mgr.contains(s.id) {
                self.mgr.free(s.id)?;
            }
        }
        self.by_id.remove(&req.id);
        self.free_slots.push_back(h);
        Ok(req)
    }

    /// Removes a request from whichever queue holds it and frees everything it held.
    /// Unknown and finished ids are a no-op (returns false).
    pub fn abort_request(&mut self, request_id: &str) -> Result<bool> {
        let Some(&h) = self.by_id.get(request_id) else {
            return Ok(false);
        };
        let status = self.req(h).status;
        match status {
            RequestStatus::Waiting | RequestStatus::Preempted => {
                let pos = self.waiting.iter().position(|&x| x == h);
                self.waiting.remove(pos.expect("waiting request is queued"));
            }
            RequestStatus::Running => {
                let pos = self.running.iter().position(|&x| x == h);
                self.running.remove(pos.expect("running request is queued"));
                self.running_seats -= self.req(h).seats();
            }
            RequestStatus::Swapped => {
                let pos = self.swapped.iter().position(|&x| x == h);
                self.swapped.remove(pos.expect("swapped request is queued"));
            }
            RequestStatus::FinishedIgnored => {
                self.pending_ignored.retain(|(x, _)| *x != h);
            }
            _ => return Ok(false),
        }
        self.req_mut(h).status = RequestStatus::FinishedAborted;
        self.release(h)?;
        self.counters.num_aborted += 1;
        Ok(true)
    }

    // ---- one step -----------------------------------------------------------------------

    /// Decides this step's work. `now` is in seconds on the clock of the arrival times
    /// (used by `delay_factor` only).
    pub fn schedule(&mut self, now: f64) -> Result<StepOutput> {
        if self.awaiting_update {
            return Err(Error::InvalidState(format!(
                "step {} has samples waiting: call update_from_output (or discard_step, if \
                 the step was not computed) before schedule()",
                self.step
            )));
        }
        self.step += 1;
        self.mgr.begin_step();
        let mut out = match self.spare_outputs.pop() {
            Some(mut out) => {
                out.reset(self.step);
                out
            }
            None => {
                // The first outputs of a run are sized for a full step (a prefill burst
                // otherwise regrows every array a few times); later ones from the last step.
                let seqs = if self.step <= 2 {
                    let budget = self.cfg.max_num_batched_tokens.min(1 << 16);
                    self.last_sizes.0.max(self.cfg.max_num_seqs.min(budget))
                } else {
                    self.last_sizes.0
                };
                StepOutput::with_capacity(self.step, seqs)
            }
        };
        for (h, reason) in std::mem::take(&mut self.pending_ignored) {
            self.finish_ignored(h, reason, &mut out)?;
        }
        let admission_delay_passed = self.passed_delay(now);
        let admitted = match self.cfg.strategy {
            Strategy::PrefillFirst => {
                self.schedule_prefill_first(admission_delay_passed, &mut out)?
            }
            Strategy::ChunkedPrefill => {
                self.schedule_chunked_prefill(admission_delay_passed, &mut out)?
            }
            Strategy::Unified => self.schedule_unified(admission_delay_passed, &mut out)?,
        };
        self.prev_prompt = admitted;
        self.requeue_preempted();
        self.pending_tables
            .retain(|t| std::sync::Arc::strong_count(t) > 1);
        self.pending_tables.push(out.seal_tables());
        self.last_handles.clear();
        self.last_handles.extend_from_slice(&out.sample_handles);
        self.last_gens.clear();
        self.last_gens.extend_from_slice(&out.sample_gens);
        self.last_seq_index.clear();
        self.last_seq_index.extend_from_slice(&out.sample_seq_index);
        self.awaiting_update = !self.last_handles.is_empty();
        self.step_open = true;
        self.counters.num_steps += 1;
        self.counters.num_batched_tokens_total += out.num_batched_tokens as u64;
        self.last_sizes = (out.num_seqs(), out.num_batched_tokens);
        Ok(out)
    }

    /// Takes back an output the caller is done with; its buffers serve a later step.
    pub fn recycle(&mut self, mut out: StepOutput) {
        let t = &out.tables;
        self.pending_tables
            .retain(|p| !std::sync::Arc::ptr_eq(p, t));
        if self.spare_outputs.len() < 2 {
            out.reclaim_rows();
            self.spare_outputs.push(out);
        }
    }

    /// Block tables of `out` as they were when it was scheduled: [S * width] row-major,
    /// padded with 0, and the width (the widest row).
    pub fn block_tables(&self, out: &StepOutput) -> (Vec<BlockId>, usize) {
        let mut t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        if t.built.is_none() {
            let built = build_tables(&self.slots, &t.rows);
            t.built = Some(built);
        }
        t.built.clone().expect("built above")
    }

    /// [T] token ids of `out`, batch order, handed to `f` (built on first access and kept).
    pub fn with_input_ids<R>(&self, out: &StepOutput, f: impl FnOnce(&[i64]) -> R) -> R {
        let mut t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        if t.input_ids.is_none() {
            let ids = build_input_ids(&self.slots, &t.rows, out.num_batched_tokens);
            t.input_ids = Some(ids);
        }
        f(t.input_ids.as_deref().expect("built above"))
    }

    /// [T] token ids of `out`, batch order.
    pub fn input_ids(&self, out: &StepOutput) -> Vec<i64> {
        self.with_input_ids(out, <[i64]>::to_vec)
    }

    /// [T] KV slot of each token of `out` (block * block_size + offset), as scheduled.
    pub fn slot_mapping(&self, out: &StepOutput) -> Vec<i64> {
        let t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        build_slot_mapping(
            &self.slots,
            &t.rows,
            t.built.as_ref(),
            self.block_size,
            out.num_batched_tokens,
        )
    }

    /// Snapshots the tables and token ids of every output still held elsewhere and not built
    /// yet: called before a sequence's table changes other than by appending (CoW,
    /// preemption, finish, release) or its tokens go away (release), after which the live
    /// state no longer describes those outputs.
    fn materialize_pending(&mut self) {
        for p in self.pending_tables.drain(..) {
            if std::sync::Arc::strong_count(&p) < 2 {
                continue;
            }
            let mut t = p.lock().unwrap_or_else(|e| e.into_inner());
            if t.built.is_none() {
                let built = build_tables(&self.slots, &t.rows);
                t.built = Some(built);
            }
            if t.input_ids.is_none() {
                let total = t.rows.iter().map(|r| r.n as usize).sum();
                let ids = build_input_ids(&self.slots, &t.rows, total);
                t.input_ids = Some(ids);
            }
        }
    }

    /// `delay_factor`: admit only once the oldest waiting request has waited
    /// `delay_factor` x the last prefill step's latency, or when nothing runs.
    fn passed_delay(&mut self, now: f64) -> bool {
        if self.prev_prompt {
            self.last_prompt_latency = now - self.prev_time;
        }
        self.prev_time = now;
        self.prev_prompt = false;
        if self.cfg.delay_factor <= 0.0 || self.waiting.is_empty() {
            return true;
        }
        let earliest = self
            .waiting
            .iter()
            .map(|&h| self.req(h).arrival_time)
            .fold(f64::INFINITY, f64::min);
        now - earliest > self.cfg.delay_factor * self.last_prompt_latency || self.running.is_empty()
    }

    fn finish_ignored(&mut self, h: u32, reason: String, out: &mut StepOutput) -> Result<()> {
        self.req_mut(h).status = RequestStatus::FinishedIgnored;
        let req = self.release(h)?;
        out.finished.push((req.id, reason));
        self.counters.num_ignored += 1;
        Ok(())
    }

    /// Takes one sampled token per sample of the latest output (`sampled[k]` belongs to
    /// `sample_seq_ids[k]`), appends it, applies the stop rules and frees what finished.
    /// `stop_hit[k]` (optional) finishes that sequence as stopped (a stop string matched).
    pub fn update_from_output(
        &mut self,
        step: u64,
        sampled: &[i64],
        stop_hit: Option<&[bool]>,
    ) -> Result<Vec<FinishedSeq>> {
        if step != self.step {
            return Err(Error::InvalidState(format!(
                "output of step {step} is not the latest (step {})",
                self.step
            )));
        }
        let k = self.last_handles.len();
        if !self.awaiting_update && k > 0 {
            return Err(Error::InvalidState(format!(
                "the samples of step {step} were already applied"
            )));
        }
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
        if let Some(i) = sampled
            .iter()
            .position(|&t| t < 0 || t > TokenId::MAX as i64)
        {
            return Err(Error::InvalidArgument(format!(
                "sampled_token_ids[{i}] = {} is not a valid token id",
                sampled[i]
            )));
        }
        self.awaiting_update = false;
        self.step_open = false;
        let max_len = self.max_seq_len;
        let mut finished = Vec::new();
        self.finished_scratch.clear();
        let mut any_request_done = false;
        let samples = self
            .last_handles
            .iter()
            .zip(&self.last_gens)
            .zip(&self.last_seq_index)
            .zip(sampled);
        for (i, (((&h, &gen), &idx), &token)) in samples.enumerate() {
            let idx = idx as u32;
            let slot = &mut self.slots[h as usize];
            if slot.gen != gen {
                continue;
            }
            // Aborted since the schedule() call: nothing to append to.
            let Some(req) = slot.req.as_mut() else {
                continue;
            };
            if req.status != RequestStatus::Running {
                continue;
            }
            let prompt_len = req.prompt_len;
            let Some(seq) = req.seqs.get_mut(idx as usize) else {
                continue;
            };
            if seq.is_finished() {
                continue;
            }
            let token = token as TokenId;
            seq.tokens.push(token);
            seq.last_token = token;
            let total = seq.tokens.len();
            let hit = stop_hit.is_some_and(|s| s[i]);
            // Common case: no rule can fire yet; skips the stop parameters' cache line.
            if !hit && total < req.quiet_until {
                continue;
            }
            let fin = if hit {
                Some((FinishReason::Stop, None))
            } else {
                req.stop.check(token, total - prompt_len, total, max_len)
            };
            let Some((reason, stop_reason)) = fin else {
                continue;
            };
            seq.finished = Some((reason, stop_reason));
            // The mirror is cleared below, once pending outputs have their snapshots.
            self.finished_scratch.push((h, idx));
            let seq_id = seq.id;
            if self.mgr.contains(seq_id) {
                self.mgr.free(seq_id)?;
            }
            req.num_unfinished -= 1;
            self.running_seats -= 1;
            let request_finished = req.num_unfinished == 0;
            if request_finished {
                req.status = match reason {
                    FinishReason::Stop => RequestStatus::FinishedStopped,
                    FinishReason::Length => RequestStatus::FinishedLengthCapped,
                };
                any_request_done = true;
            }
            finished.push(FinishedSeq {
                request_id: req.id.clone(),
                seq_index: idx as usize,
                reason,
                stop_reason,
                request_finished,
            });
        }
        if !self.finished_scratch.is_empty() {
            self.materialize_pending();
            for &(h, idx) in &self.finished_scratch {
                if let Some(req) = self.slots[h as usize].req.as_mut() {
                    req.seqs[idx as usize].table.clear();
                }
            }
        }
        if any_request_done {
            let slots = &self.slots;
            let mut done = Vec::new();
            self.running.retain(|&h| {
                let keep = slots[h as usize]
                    .req
                    .as_ref()
                    .is_some_and(|r| !r.status.is_finished());
                if !keep {
                    done.push(h);
                }
                keep
            });
            for h in done {
                self.release(h)?;
                self.counters.num_finished += 1;
            }
        }
        Ok(finished)
    }

    /// Takes back the latest step, whose computation failed (the caller could not run or
    /// sample it): every request it scheduled, and every group it swapped out, goes back to
    /// the head of `waiting` to be recomputed from its tokens (the KV written by the step,
    /// its copies and swaps may be missing or partial; generated tokens are kept), and the
    /// blocks it registered in the prefix cache are forgotten. Requests it finished as
    /// ignored stay finished. Returns the ids of the requests rolled back.
    pub fn discard_step(&mut self, out: &StepOutput) -> Result<Vec<String>> {
        if out.step != self.step || !self.step_open {
            return Err(Error::InvalidState(format!(
                "only the latest step can be discarded, before update_from_output (step {}, \
                 latest {}{})",
                out.step,
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
        self.last_handles.clear();
        self.last_gens.clear();
        self.last_seq_index.clear();
        let live = |slots: &[Slot], h: u32, g: u32| {
            slots[h as usize].gen == g && slots[h as usize].req.is_some()
        };
        let mut touched: std::collections::HashSet<u32> = out
            .handles
            .iter()
            .zip(&out.gens)
            .filter(|&(&h, &g)| live(&self.slots, h, g))
            .map(|(&h, _)| h)
            .collect();
        // Groups this step swapped out: their copy to host may not have happened.
        let swapped_out: Vec<u32> = out
            .preempted
            .iter()
            .filter_map(|id| self.by_id.get(id).copied())
            .filter(|&h| self.req(h).status == RequestStatus::Swapped)
            .collect();
        let counters = self.counters;
        let mut scratch = StepOutput::with_capacity(self.step, 0);
        let mut rolled_back = Vec::with_capacity(touched.len() + swapped_out.len());
        for &h in swapped_out.iter().rev() {
            let pos = self.swapped.iter().position(|&x| x == h);
            self.swapped.remove(pos.expect("swapped request is queued"));
            self.drop_swapped_to_recompute(h)?;
            rolled_back.push(self.req(h).id.clone());
        }
        // Tail first, as preemption victims are taken, so the requeue keeps running's order.
        let victims: Vec<u32> = self
            .running
            .iter()
            .rev()
            .copied()
            .filter(|h| touched.remove(h))
            .collect();
        for h in victims {
            let pos = self.running.iter().position(|&x| x == h);
            self.running.remove(pos.expect("running request is queued"));
            self.preempt(h, &mut scratch, true)?;
            rolled_back.push(self.req(h).id.clone());
        }
        self.requeue_preempted();
        self.mgr.forget_step_registrations()?;
        // A rollback is not a preemption: the statistics keep counting real ones only.
        self.counters = SchedulerCounters {
            num_rolled_back_steps: counters.num_rolled_back_steps + 1,
            ..counters
        };
        Ok(rolled_back)
    }

    /// A swapped-out group gives its host blocks back and is recomputed instead (queued by
    /// `requeue_preempted`).
    fn drop_swapped_to_recompute(&mut self, h: u32) -> Result<()> {
        let req = self.slots[h as usize]
            .req
            .as_mut()
            .expect("swapped request exists");
        let active: Vec<usize> = req.active_seqs().collect();
        for i in active {
            let s = &mut req.seqs[i];
            if self.mgr.contains(s.id) {
                self.mgr.free(s.id)?;
            }
            s.num_computed = 0;
            s.table.clear();
            s.tail_shared = false;
        }
        req.forked = false;
        req.status = RequestStatus::Preempted;
        self.preempted_recompute.push(h);
        Ok(())
    }

    // ---- consistency --------------------------------------------------------------------

    /// The manager's invariants plus the scheduler's own: every live request sits in exactly
    /// one place matching its status; seats add up; mirrored tables equal the manager's;
    /// waiting requests hold no blocks, swapped ones only host blocks.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.mgr.check_invariants()?;
        let mut place: HashMap<u32, &str> = HashMap::new();
        let mut mark = |h: u32, q: &'static str| -> std::result::Result<(), String> {
            match place.insert(h, q) {
                None => Ok(()),
                Some(prev) => Err(format!("request slot {h} is in both {prev} and {q}")),
            }
        };
        for &h in &self.waiting {
            mark(h, "waiting")?;
        }
        for &h in &self.running {
            mark(h, "running")?;
        }
        for &h in &self.swapped {
            mark(h, "swapped")?;
        }
        for &(h, _) in &self.pending_ignored {
            mark(h, "ignored")?;
        }
        let live = self.slots.iter().filter(|s| s.req.is_some()).count();
        if live != place.len() || live != self.by_id.len() {
            return Err(format!(
                "{live} live requests, {} queued, {} ids",
                place.len(),
                self.by_id.len()
            ));
        }
        let mut seats = 0;
        for (&h, &q) in &place {
            let Some(req) = self.slots[h as usize].req.as_ref() else {
                return Err(format!("queue {q} names empty slot {h}"));
            };
            let ok = match q {
                "waiting" => req.status.is_waiting(),
                "running" => req.status == RequestStatus::Running,
                "swapped" => req.status == RequestStatus::Swapped,
                _ => req.status == RequestStatus::FinishedIgnored,
            };
            if !ok {
                return Err(format!(
                    "request {} in {q} has status {:?}",
                    req.id, req.status
                ));
            }
            if req.num_unfinished != req.seqs.iter().filter(|s| !s.is_finished()).count() {
                return Err(format!("request {}: unfinished count is off", req.id));
            }
            let active: Vec<usize> = req.active_seqs().collect();
            for (i, s) in req.seqs.iter().enumerate() {
                let holds = q == "running" || q == "swapped";
                let should_hold = holds && active.contains(&i);
                if self.mgr.contains(s.id) != should_hold {
                    return Err(format!(
                        "request {} seq {i} ({q}): manager holds it: {}",
                        req.id,
                        self.mgr.contains(s.id)
                    ));
                }
                if should_hold && self.mgr.is_swapped(s.id) != (q == "swapped") {
                    return Err(format!("request {} seq {i}: wrong pool", req.id));
                }
                if q == "running" && should_hold {
                    let table = self.mgr.block_table(s.id).map_err(|e| e.to_string())?;
                    if table != s.table.as_slice()
                        || s.table.last_block() != *table.last().unwrap_or(&0)
                    {
                        return Err(format!(
                            "request {} seq {i}: stale block table mirror",
                            req.id
                        ));
                    }
                    if s.table.num_blocks() != s.table.len() || req.first_seq_id + i as u64 != s.id
                    {
                        return Err(format!("request {} seq {i}: stale inline copies", req.id));
                    }
                    if s.tokens.last() != Some(&s.last_token) {
                        return Err(format!("request {} seq {i}: stale last_token", req.id));
                    }
                    if s.num_computed > s.tokens.len()
                        || s.num_computed > s.table.len() * self.block_size
                    {
                        return Err(format!(
                            "request {} seq {i}: computed past its slots",
                            req.id
                        ));
                    }
                }
                let stale_progress = q == "waiting" && !s.is_finished() && s.num_computed != 0;
                if !should_hold && (!s.table.is_empty() || stale_progress) {
                    return Err(format!("request {} seq {i}: holds state while {q}", req.id));
                }
            }
            if q == "running" {
                seats += req.seats();
            }
        }
        if seats != self.running_seats {
            return Err(format!("running seats {} != {seats}", self.running_seats));
        }
        if self.running_seats > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running sequences exceed max_num_seqs={}",
                self.running_seats, self.cfg.max_num_seqs
            ));
        }
        Ok(())
    }
}

/// Lays out `rows` (each a prefix of a live sequence's table) as a padded matrix.
fn build_tables(slots: &[Slot], rows: &[TableRow]) -> (Vec<BlockId>, usize) {
    let width = rows.iter().map(|r| r.len).max().unwrap_or(0) as usize;
    let mut data = vec![0; rows.len() * width];
    for (dst, r) in data.chunks_exact_mut(width.max(1)).zip(rows) {
        let table = &slots[r.handle as usize]
            .req
            .as_ref()
            .expect("a pending output's request is live (released ones were snapshotted)")
            .seqs[r.seq as usize]
            .table;
        dst[..r.len as usize].copy_from_slice(&table[..r.len as usize]);
    }
    (data, width)
}

/// The live sequence a pending output's row names (released ones were snapshotted).
#[inline]
fn row_seq<'a>(slots: &'a [Slot], r: &TableRow) -> &'a Sequence {
    &slots[r.handle as usize]
        .req
        .as_ref()
        .expect("a pending output's request is live (released ones were snapshotted)")
        .seqs[r.seq as usize]
}

/// [total] token ids of `rows`: a decode row's is inline, a longer row's are a slice of its
/// sequence's (append-only) history.
fn build_input_ids(slots: &[Slot], rows: &[TableRow], total: usize) -> Vec<i64> {
    let mut v = Vec::with_capacity(total);
    for r in rows {
        if r.n == 1 {
            v.push(r.token as i64);
        } else {
            let (start, end) = (r.start as usize, (r.start + r.n) as usize);
            v.extend(
                row_seq(slots, r).tokens[start..end]
                    .iter()
                    .map(|&t| t as i64),
            );
        }
    }
    v
}

/// [total] KV slots of `rows`: a decode row's is inline, a longer row's come from its table
/// (the snapshot `built` when there is one, else the live mirror's prefix).
fn build_slot_mapping(
    slots: &[Slot],
    rows: &[TableRow],
    built: Option<&(Vec<BlockId>, usize)>,
    bs: usize,
    total: usize,
) -> Vec<i64> {
    let mut v = Vec::with_capacity(total);
    for (i, r) in rows.iter().enumerate() {
        if r.n == 1 {
            v.push(r.slot);
            continue;
        }
        let table: &[BlockId] = match built {
            Some((data, w)) => &data[i * w..i * w + r.len as usize],
            None => &row_seq(slots, r).table[..r.len as usize],
        };
        let (mut p, end) = (r.start as usize, (r.start + r.n) as usize);
        while p < end {
            let b = p / bs;
            let block_end = end.min((b + 1) * bs);
            let base = (table[b] as usize * bs) as i64 - (b * bs) as i64;
            v.extend(((p as i64)..(block_end as i64)).map(|q| base + q));
            p = block_end;
        }
    }
    v
}

#[cfg(test)]
mod tests;
