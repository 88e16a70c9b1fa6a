//! A KV connector attached to the scheduler (`crate::connector`): a request whose prefix the
//! connector holds past the device hit has it loaded instead of computed; finished requests'
//! blocks stay allocated while the connector saves them (delay_free).
//!
//! Loads come two ways, as the connector answers (`is_async`):
//! - Synchronous (the host tier, `start_sync_load`): admission allocates blocks for the
//!   external tokens, counts them as computed and schedules the rest of the request in the
//!   same step; the workers copy the blocks in before that step's forward and report the
//!   load before its output (`update_from_output` refuses until they have). A failed block
//!   fails the whole step: the caller discards it (`discard_step`), which forgets the
//!   step's prefix-cache registrations (the loaded blocks among them), and every request
//!   of the step comes back; the connector has forgotten the failed entries, so the request
//!   loads the blocks before the first failed one again and computes the rest. Another
//!   request of the step may have hit the loaded blocks, so rolling back the one request
//!   alone would not do.
//! - Asynchronous (the disk tier, parked by `match_remote_kvs` at admission, `promote` when
//!   reported): the request's leader gets a table of its device hit plus fresh blocks for
//!   the external tokens, keeps its place in `waiting` (admission steps over it, others
//!   pass) in `WAITING_FOR_REMOTE_KVS`; once the load is reported the blocks that loaded
//!   (up to the first failed one) are registered in the device prefix cache and the table
//!   is given back, so the request's next admission finds them as an ordinary prefix hit
//!   and computes only the rest (a failed block and those after it are computed again; the
//!   connector forgets the failed entry).
//!
//! Saves: a finished or aborted request's computed full blocks (`hold`), and a request's
//! preempted by recompute (`save_before_recompute`, held by a fork of its table). These are
//! the ways a block reaches the device cache's evictable pool, so a block the device cache
//! evicts is already in the tier (or was refused by a full one): no save at eviction time,
//! when the block is about to be overwritten. A request is never parked on a device hit
//! that the step being built computes (a discarded step would leave it holding blocks
//! without their KV).
//!
//! Blocks that the workers may still be writing or reading are never freed early: an
//! aborted loading request, or a finished one being saved, leaves its sequence in `held`
//! under the transfer until the workers report it.
//!
//! Seats: a parked request, and a promoted one until its admission, holds a seat of
//! `max_num_seqs` (`reserved_seats`), so no more requests load than can be admitted next. A
//! candidate short only of those seats steps aside while a promoted request waits (under
//! `priority` a newcomer ranks first, and would otherwise wait for seats only they free).
//! Without that bound every waiting request whose prefix the tier holds parked at once, and
//! on a device cache smaller than their prefixes together the later loads evicted the earlier
//! ones' blocks before those were admitted: the same blocks loaded again and again, and a
//! batch admitted over several steps. The loaded blocks themselves are not kept for the
//! promoted request (they are evictable like any cached block): kept, the loads of requests
//! holding seats could fill the device cache and leave the first of them no block for its
//! last token, with nothing running to free one (0b2dbdb did that and stalled the
//! multi-turn benchmark). A synchronously loaded request is admitted at once: it holds its
//! seat as any running request does.
//!
//! Scope: single-sequence requests (`n = 1`) with prefix caching on (the tier is keyed by
//! its hashes); `n > 1` requests run as if no connector were attached.
use std::collections::{HashMap, HashSet};

use crate::connector::{ConnectorOutput, ConnectorRequest, KvConnector};
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv::{KvCacheManager, Location, PrefixHit};
use crate::scheduler::output::StepOutput;
use crate::scheduler::state::request::{Request, RequestStatus};
use crate::scheduler::Scheduler;

/// A synchronous load of the latest step, not reported yet.
#[derive(Debug, Clone)]
struct SyncLoad {
    handle: u32,
    gen: u32,
    /// The device blocks it writes.
    blocks: Vec<BlockId>,
    /// It came with the request's first admission (which counted its tokens as cached).
    first: bool,
}

/// What admission does with a waiting request's connector match (`match_remote_kvs`).
#[derive(Debug)]
pub(in crate::scheduler) enum RemoteKvs {
    /// Nothing to load: admitted on its device hit as usual.
    None(PrefixHit),
    /// Parked while an asynchronous load runs.
    Parked,
    /// A synchronous load of `external` tokens past the device hit, in the admitting step
    /// (`hashes`: the chain hashes of its full blocks, for the connector).
    Sync {
        hit: PrefixHit,
        hashes: Vec<u64>,
        external: usize,
    },
}

/// A parked request's load.
#[derive(Debug, Clone, Copy)]
struct Loading {
    handle: u32,
    seq: SeqId,
    /// Its first loaded block and how many.
    first_block: usize,
    num_blocks: usize,
    /// Its status before it was parked (`Waiting`, or `Preempted` for one coming back).
    prev: RequestStatus,
}

#[derive(Debug, Default)]
pub(in crate::scheduler) struct ConnectorState {
    connector: Option<Box<dyn KvConnector>>,
    next_job: u64,
    loading: HashMap<u64, Loading>,
    /// Transfer -> sequences whose blocks stay allocated until it is reported.
    held: HashMap<u64, Vec<SeqId>>,
    /// Requests promoted (their load reported) and not admitted yet: each holds a seat.
    promoted: HashSet<u32>,
    /// Synchronous loads not reported yet (all of the latest step).
    syncing: HashMap<u64, SyncLoad>,
    /// Synchronous loads of the step being built, for its meta.
    sync_jobs: Vec<u64>,
    /// A synchronous load of the latest step failed: it is discarded, not applied.
    sync_failed: bool,
    /// Set while `discard_step` sends the failed step's requests back: their blocks may
    /// never have received their KV, so nothing is saved from them.
    pub(in crate::scheduler) discarding: bool,
}

impl ConnectorState {
    #[inline]
    pub(in crate::scheduler) fn is_attached(&self) -> bool {
        self.connector.is_some()
    }

    fn next_job(&mut self) -> u64 {
        self.next_job += 1;
        self.next_job
    }

    /// Whether the latest step's output may be applied: its synchronous loads are reported
    /// and none failed (`update_from_output`).
    #[inline]
    pub(in crate::scheduler) fn check_step_output(&self) -> Result<()> {
        if self.syncing.is_empty() && !self.sync_failed {
            return Ok(());
        }
        Err(self.step_output_refused())
    }

    #[cold]
    fn step_output_refused(&self) -> Error {
        Error::InvalidState(if self.sync_failed {
            "a synchronous KV load of this step failed: call discard_step (its requests \
             compute those tokens again)"
                .into()
        } else {
            let mut jobs: Vec<u64> = self.syncing.keys().copied().collect();
            jobs.sort_unstable();
            format!(
                "the step's synchronous KV loads (transfers {jobs:?}) are not reported yet: \
                 call update_connector_output first"
            )
        })
    }

    /// `discard_step` of the latest step: its synchronous loads must be reported first
    /// (their blocks are being written until then).
    pub(in crate::scheduler) fn check_sync_loads_reported(&self) -> Result<()> {
        match self.syncing.is_empty() {
            true => Ok(()),
            false => Err(self.step_output_refused()),
        }
    }

    /// Whether transfer `job` is a synchronous load not reported yet (invariants).
    pub(in crate::scheduler) fn is_syncing(&self, job: u64) -> bool {
        self.syncing.contains_key(&job)
    }

    /// The latest step was discarded: a synchronous load's failure is dealt with.
    pub(in crate::scheduler) fn clear_sync_failure(&mut self) {
        self.sync_failed = false;
    }

    /// Sequences the held transfers keep in the manager.
    pub(in crate::scheduler) fn num_held_seqs(&self) -> usize {
        self.held.values().map(Vec::len).sum()
    }

    /// Seats held by requests other than `h` that are loading or loaded and not admitted yet
    /// (a `WAITING_FOR_REMOTE_KVS` request is never a candidate itself).
    #[inline]
    pub(in crate::scheduler) fn reserved_seats(&self, h: u32) -> usize {
        self.loading.len() + self.promoted.len() - usize::from(self.promoted.contains(&h))
    }

    /// Whether a request other than `h` is loaded and waits for admission.
    #[inline]
    pub(in crate::scheduler) fn has_promoted_besides(&self, h: u32) -> bool {
        self.promoted.len() > usize::from(self.promoted.contains(&h))
    }

    /// Request `h` was admitted or released: the seat its load held is its own or free.
    #[inline]
    pub(in crate::scheduler) fn unstage(&mut self, h: u32) {
        self.promoted.remove(&h);
    }

    /// Requests promoted and not admitted yet (handles), for the invariants.
    pub(in crate::scheduler) fn promoted(&self) -> impl Iterator<Item = u32> + '_ {
        self.promoted.iter().copied()
    }

    pub(in crate::scheduler) fn connector(&self) -> Option<&dyn KvConnector> {
        self.connector.as_deref()
    }

    /// Request `req` gives back its blocks (it finished, or was aborted): the sequence whose
    /// blocks must stay allocated, if any, moved to `held` (the caller frees the others). A
    /// load in flight keeps its blocks (the workers may still write them); otherwise the
    /// connector may save the computed full blocks of a single-sequence request
    /// (`request_finished` -> delay_free).
    pub(in crate::scheduler) fn hold(
        &mut self,
        req: &Request,
        mgr: &KvCacheManager,
    ) -> Option<SeqId> {
        self.connector.as_ref()?;
        let job = req.extras.remote_job;
        if job != 0 && self.syncing.contains_key(&job) {
            // Aborted before its synchronous load was reported: the workers write its blocks.
            let seq = req.seqs[0].id;
            self.held.entry(job).or_default().push(seq);
            return Some(seq);
        }
        if job != 0 {
            let l = self.loading.remove(&job)?;
            self.held.entry(job).or_default().push(l.seq);
            return Some(l.seq);
        }
        if req.seqs.len() != 1 {
            return None;
        }
        let seq = req.seqs[0].id;
        if self.held.values().any(|seqs| seqs.contains(&seq)) {
            return Some(seq); // held when it finished (a save in flight)
        }
        let job = self.offer_save(req, mgr)?;
        self.held.insert(job, vec![seq]);
        Some(seq)
    }

    /// Offers the computed full blocks of single-sequence request `req` (on the device) to
    /// the connector (`request_finished`); returns the save's transfer when it takes some.
    /// The caller holds blocks under it until the save is reported.
    fn offer_save(&mut self, req: &Request, mgr: &KvCacheManager) -> Option<u64> {
        let connector = self.connector.as_mut()?;
        let table = mgr.table(req.seqs[0].id).ok()?;
        if table.location != Location::Device || table.num_registered == 0 {
            return None;
        }
        let n = table.num_registered;
        let job = self.next_job + 1;
        let creq = ConnectorRequest {
            id: &req.id,
            job,
            tokens: &req.seqs[0].tokens,
            block_hashes: &table.hashes[..n],
        };
        if !connector.request_finished(&creq, &table.blocks[..n]) {
            return None;
        }
        self.next_job = job;
        Some(job)
    }
}

impl Scheduler {
    /// Attaches `connector` (before any request is added). Needs prefix caching: the
    /// connector's entries are keyed by the prefix cache's block hashes.
    pub fn set_kv_connector(&mut self, connector: Box<dyn KvConnector>) -> Result<()> {
        if !self.caching() {
            return Err(Error::InvalidArgument(
                "a KV connector (kv_offloading_size) needs enable_prefix_caching=True: its \
                 blocks are keyed by the prefix cache's hashes"
                    .into(),
            ));
        }
        if self.has_unfinished_requests() {
            return Err(Error::InvalidState(
                "a KV connector is attached before any request is added".into(),
            ));
        }
        if self.mgr.is_hybrid() {
            return Err(Error::InvalidArgument(
                "a KV connector (kv_offloading_size) moves one block row per sequence: not \
                 supported with sliding-window (hybrid) KV groups yet"
                    .into(),
            ));
        }
        self.kv.connector = Some(connector);
        Ok(())
    }

    pub fn kv_connector(&self) -> Option<&dyn KvConnector> {
        self.kv.connector()
    }

    /// The connector, to turn on and drain its KV events (`bindings/kv_events.rs`).
    pub fn kv_connector_mut(&mut self) -> Option<&mut (dyn KvConnector + 'static)> {
        self.kv.connector.as_deref_mut()
    }

    /// Request `h` is preempted by recompute: the connector may save its computed full
    /// blocks first, since the device cache may evict them before it comes back (every other
    /// way a block reaches the device cache's evictable pool, a finish or an abort, saves it
    /// already, so by the time the device cache evicts a block the tier has it). A fork of
    /// its table under a fresh sequence id holds them until the save is reported; the
    /// request's own sequence is freed as usual and finds them as a prefix hit when it is
    /// admitted again. Single-sequence requests on the device only.
    pub(in crate::scheduler) fn save_before_recompute(&mut self, h: u32) -> Result<()> {
        let req = self.store.get(h);
        if self.kv.discarding
            || req.seqs.len() != 1
            || req.extras.remote_job != 0
            || !self.mgr.contains(req.seqs[0].id)
        {
            return Ok(());
        }
        let seq = req.seqs[0].id;
        let Some(job) = self.kv.offer_save(req, &self.mgr) else {
            return Ok(());
        };
        let copy = self.store.next_ids(1).0;
        let registered = self.mgr.table(seq)?.num_registered;
        self.mgr.fork(seq, copy)?;
        // Only the saved (registered) blocks are held; the tail goes back with the request's.
        self.mgr
            .truncate_slots(copy, registered * self.mgr.block_size())?;
        self.kv.held.insert(job, vec![copy]);
        Ok(())
    }

    /// Blocks (by hash) whose tier copy the workers deleted (the disk tier's evictions): the
    /// connector publishes them removed.
    pub fn kv_tier_removed(&mut self, hashes: &[u64]) {
        if let Some(connector) = self.kv.connector.as_mut() {
            connector.tier_removed(hashes);
        }
    }

    /// Loads or saves the workers have not reported yet.
    pub fn has_pending_transfers(&self) -> bool {
        !self.kv.loading.is_empty() || !self.kv.held.is_empty() || !self.kv.syncing.is_empty()
    }

    /// Requests waiting in `WAITING_FOR_REMOTE_KVS`.
    pub fn num_waiting_for_remote_kvs(&self) -> usize {
        self.kv.loading.len()
    }

    /// Admission of waiting request `h`, whose leader's device hit is `hit`: what the
    /// connector can load past it. An asynchronous load gets the leader blocks for the
    /// external tokens and parks the request (`Parked`: the hit was consumed; when the blocks
    /// do not fit now it is admitted as usual, and the usual admission answers LATER); a
    /// synchronous one is returned for admission to allocate and schedule in this step
    /// (`start_sync_load`). `Err` only from the manager.
    pub(in crate::scheduler) fn match_remote_kvs(
        &mut self,
        h: u32,
        hit: PrefixHit,
    ) -> Result<RemoteKvs> {
        let Some(connector) = self.kv.connector.as_mut() else {
            return Ok(RemoteKvs::None(hit));
        };
        let req = self.store.get(h);
        if req.seqs.len() != 1 {
            return Ok(RemoteKvs::None(hit));
        }
        let s = &req.seqs[0];
        let target = req.leader_target();
        let computed = hit.num_cached_tokens;
        let creq = ConnectorRequest {
            id: &req.id,
            job: 0,
            tokens: &s.tokens[..target],
            block_hashes: &hit.hashes,
        };
        let (external, is_async) = connector.get_num_new_matched_tokens(&creq, computed);
        let bs = self.mgr.block_size();
        if external == 0 || external % bs != 0 || computed + external >= target {
            return Ok(RemoteKvs::None(hit));
        }
        if !is_async {
            let hashes = hit.hashes.clone();
            return Ok(RemoteKvs::Sync {
                hit,
                hashes,
                external,
            });
        }
        // A parked request is no row of this step: if the step is discarded it is not sent
        // back, so it must not hold blocks the step is computing (their KV may never come).
        if hit.blocks.iter().any(|&b| self.mgr.registered_this_step(b)) {
            return Ok(RemoteKvs::None(hit));
        }
        let seq = s.id;
        let hashes = hit.hashes.clone();
        if !self.mgr.allocate(seq, &hit, computed + external, true)? {
            return Ok(RemoteKvs::None(hit));
        }
        let job = self.kv.next_job();
        let req = self.store.get_mut(h);
        let creq = ConnectorRequest {
            id: &req.id,
            job,
            tokens: &req.seqs[0].tokens[..target],
            block_hashes: &hashes,
        };
        let blocks = self.mgr.block_table(seq)?;
        let connector = self.kv.connector.as_mut().expect("checked above");
        connector.update_state_after_alloc(&creq, blocks, external);
        self.kv.loading.insert(
            job,
            Loading {
                handle: h,
                seq,
                first_block: computed / bs,
                num_blocks: external / bs,
                prev: req.status,
            },
        );
        req.status = RequestStatus::WaitingForRemoteKvs;
        req.extras.remote_job = job;
        // Promoted before, parked again (its loaded blocks were evicted): the same seat.
        self.kv.promoted.remove(&h);
        Ok(RemoteKvs::Parked)
    }

    /// Request `h`, just allocated up to and past `computed` tokens (its device hit plus
    /// `external` tokens the connector loads synchronously; `hashes`: its full blocks'),
    /// hands the connector the blocks to load: they are written before this step's forward.
    pub(in crate::scheduler) fn start_sync_load(
        &mut self,
        h: u32,
        hashes: &[u64],
        computed: usize,
        external: usize,
    ) -> Result<()> {
        let bs = self.mgr.block_size();
        let job = self.kv.next_job();
        let gen = self.store.gen(h);
        let req = self.store.get_mut(h);
        let target = req.leader_target();
        let blocks = &self.mgr.block_table(req.seqs[0].id)?[..computed / bs];
        let creq = ConnectorRequest {
            id: &req.id,
            job,
            tokens: &req.seqs[0].tokens[..target],
            block_hashes: hashes,
        };
        let connector = self.kv.connector.as_mut().expect("a match came from it");
        connector.update_state_after_alloc(&creq, blocks, external);
        let loaded = blocks[(computed - external) / bs..].to_vec();
        self.kv.syncing.insert(
            job,
            SyncLoad {
                handle: h,
                gen,
                blocks: loaded,
                first: !req.admitted_once,
            },
        );
        self.kv.sync_jobs.push(job);
        req.extras.remote_job = job;
        if !req.admitted_once {
            req.extras.num_external_tokens += external;
        }
        Ok(())
    }

    /// The connector's loads and saves of this step, into `out` (end of `schedule`).
    #[inline]
    pub(in crate::scheduler) fn seal_connector_meta(&mut self, out: &mut StepOutput) {
        if let Some(connector) = self.kv.connector.as_mut() {
            let meta = out.kv_meta.get_or_insert_with(Default::default);
            connector.build_connector_meta(meta);
            meta.sync_jobs.append(&mut self.kv.sync_jobs);
        }
    }

    /// The workers' report (vLLM's `get_finished`): transfers whose loads are done (with the
    /// device blocks that failed to load) and whose saves are done. Parked requests whose
    /// load is done go back to `waiting`'s ordinary admission; held blocks are freed. A
    /// synchronous load with a failed block fails its step: `update_from_output` refuses it
    /// and the caller discards it. An id the scheduler does not know is an error, and
    /// nothing is applied then.
    pub fn update_connector_output(
        &mut self,
        finished_recving: &[u64],
        finished_sending: &[u64],
        invalid_blocks: &[BlockId],
    ) -> Result<()> {
        for job in finished_recving {
            if !self.kv.loading.contains_key(job)
                && !self.kv.held.contains_key(job)
                && !self.kv.syncing.contains_key(job)
            {
                return Err(unknown_transfer("finished_recving", *job));
            }
        }
        for job in finished_sending {
            if !self.kv.held.contains_key(job) || self.kv.loading.contains_key(job) {
                return Err(unknown_transfer("finished_sending", *job));
            }
        }
        let Some(connector) = self.kv.connector.as_mut() else {
            return Ok(());
        };
        connector.update_connector_output(&ConnectorOutput {
            finished_recving,
            finished_sending,
            invalid_blocks,
        });
        for job in finished_sending.iter().chain(finished_recving) {
            if let Some(seqs) = self.kv.held.remove(job) {
                for seq in seqs {
                    self.mgr.free(seq)?;
                }
            }
        }
        for job in finished_recving {
            if let Some(l) = self.kv.loading.remove(job) {
                self.promote(l, invalid_blocks)?;
            }
            if let Some(l) = self.kv.syncing.remove(job) {
                let bs = self.mgr.block_size();
                let failed = l.blocks.iter().position(|b| invalid_blocks.contains(b));
                self.kv.sync_failed |= failed.is_some();
                if !self.store.is_live(l.handle, l.gen) {
                    continue;
                }
                let req = self.store.get_mut(l.handle);
                if req.extras.remote_job == *job {
                    req.extras.remote_job = 0;
                }
                if let (Some(i), true) = (failed, l.first) {
                    // Its first admission counted tokens that never loaded: the step is
                    // discarded and they are computed (or loaded) again, counted then.
                    let lost = (l.blocks.len() - i) * bs;
                    req.num_cached_tokens -= lost;
                    req.extras.num_external_tokens -= lost;
                }
            }
        }
        Ok(())
    }

    /// A parked request whose load is done: the blocks that loaded go to the device prefix
    /// cache (up to the first failed one), its table is given back, it waits as before.
    fn promote(&mut self, l: Loading, invalid_blocks: &[BlockId]) -> Result<()> {
        let bs = self.mgr.block_size();
        let table = self.mgr.block_table(l.seq)?;
        let loaded = table[l.first_block..l.first_block + l.num_blocks]
            .iter()
            .take_while(|b| !invalid_blocks.contains(b))
            .count();
        let req = self.store.get_mut(l.handle);
        let s = &req.seqs[0];
        self.mgr.cache_full_blocks(
            l.seq,
            &s.tokens,
            (l.first_block + loaded) * bs,
            req.extra_key,
        )?;
        self.mgr.free(l.seq)?;
        self.kv.promoted.insert(l.handle);
        req.status = l.prev;
        req.extras.remote_job = 0;
        if !req.admitted_once {
            // Summed over its loads (a request whose loaded blocks were evicted before its
            // admission parks again); the first admission caps it at what it found.
            req.extras.num_external_tokens += loaded * bs;
        }
        Ok(())
    }
}

#[cold]
fn unknown_transfer(field: &str, job: u64) -> Error {
    Error::InvalidArgument(format!(
        "{field}: transfer {job} is not one the scheduler is waiting for (unknown, or \
         reported twice)"
    ))
}
