//! Data-parallel routing: which replica serves a request.
//!
//! [`index::PrefixIndex`] knows every replica's prefix cache exactly (built from its KV
//! events). Per request, [`Router::route`] hashes the prompt's blocks once, with the function
//! and the LoRA salt the cache itself uses (`kv::prefix_cache`), counts each replica's leading
//! matched blocks and picks by policy:
//! - `cache_aware` (default): the best of matched-prefix fraction minus a load penalty and,
//!   with `token_weight` > 0, a prefill-cost penalty (the replica's in-flight uncached prompt
//!   tokens plus this prompt's uncached tokens there: an estimate of its time to first token,
//!   as NVIDIA Dynamo's KV router scores), unless the replicas' loads are out of balance beyond
//!   a bound (SGLang's guard: max - min over `balance_abs_threshold` and max over
//!   `balance_rel_threshold` x min), then least loaded;
//! - `least_loaded`: fewest requests in flight (then waiting + running, then KV usage);
//! - `round_robin`: the next live replica in turn;
//! - `session`: sticky by a session key (rendezvous hashing over the live replicas, so a
//!   replica leaving moves only its own sessions).
//!
//! A routed prompt's blocks count as held by its replica (pending) from `route` until the
//! request finishes (`finish`), `pending_ttl` seconds at most (a bound for a finish that never
//! comes): the replica holds them or will once that request's prefill runs, since a waiting
//! or preempted request computes again whatever was evicted and a running one's blocks cannot
//! be evicted. So a burst sharing a new prefix follows its first request however long that one
//! waits, and after it ends the events alone speak: an eviction is seen at once. (The
//! simulation's approximate baseline, what was sent where recorded for good, is this router fed
//! its own record instead of events: `pagedllm.router.sim.ApproximateRouter`.)
//!
//! `cache_aware` also remembers where each block was last routed (bounded: two generations of
//! `AFFINITY_CAPACITY` hashes) and counts a block that replica no longer holds as
//! `affinity_weight` of a held one: a prefix evicted everywhere goes back where it went, so the
//! prefixes stay partitioned over the replicas instead of being copied onto the least loaded.
//! A prompt that matches nothing anywhere (a new prefix) goes to the replica fewest remembered
//! blocks were last routed to (then least loaded; among the replicas within
//! `NEW_PREFIX_SLACK` in flight of the least loaded): new conversations and system prompts are
//! spread by the cache they will claim, not by the moment's queue, which a short first turn
//! barely touches and which leaves some replicas a prefix more than their cache holds.
//!
//! Last, `cache_aware` weighs the replica its score picked against the one with the least
//! prefill ahead of this prompt's first token (its in-flight uncached prompt tokens plus this
//! prompt's tokens it does not hold or have pending): where the pick's is over
//! `divert_ratio` x that, the request goes there instead. The exact index is what makes this
//! safe: a prefix its home has evicted is counted as recompute there, so the request leaves a
//! long queue when the hit it would wait for is gone or small next to the queue, and stays for a
//! hit that is still held and worth the wait.
//!
//! A replica's offload tiers count too (their KV events carry vLLM's `medium`): past its
//! device prefix, blocks its host or disk tier holds extend the match, each worth
//! `HOST_HIT_WEIGHT` / `DISK_HIT_WEIGHT` of a device block in `cache_aware`'s score (a copy
//! into the device costs less than computing the block again, more than finding it there).
pub mod foreign;
pub mod index;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::error::{Error, Result};
use crate::ids::TokenId;
use crate::kv::prefix_cache::{chain_hashes, PrefixCache};
use crate::kv::{salted_key, IdBuildHasher};
pub use index::{Applied, PrefixIndex, DEFAULT_CAPACITY, MAX_REPLICAS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutingPolicy {
    CacheAware,
    LeastLoaded,
    RoundRobin,
    Session,
}

impl RoutingPolicy {
    pub const ALL: [RoutingPolicy; 4] = [
        RoutingPolicy::CacheAware,
        RoutingPolicy::LeastLoaded,
        RoutingPolicy::RoundRobin,
        RoutingPolicy::Session,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RoutingPolicy::CacheAware => "cache_aware",
            RoutingPolicy::LeastLoaded => "least_loaded",
            RoutingPolicy::RoundRobin => "round_robin",
            RoutingPolicy::Session => "session",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == name)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|p| p.as_str()).collect();
                Error::InvalidArgument(format!(
                    "routing_policy must be one of {}, got {name:?}",
                    names.join(", ")
                ))
            })
    }
}

/// The router's knobs; `defaults` holds their default values (the one place they are written).
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    pub num_replicas: usize,
    pub block_size: usize,
    pub policy: RoutingPolicy,
    pub balance_abs_threshold: u32,
    pub balance_rel_threshold: f64,
    /// Weight of the load penalty against the matched-prefix fraction (in [0, 1]).
    pub load_weight: f64,
    /// Weight of the prefill-cost penalty against the matched-prefix fraction (in [0, 1]).
    pub token_weight: f64,
    /// The longest a routed request's blocks count as pending (seconds).
    pub pending_ttl: f64,
    /// What a block counts for on the replica it was last routed to once that replica no
    /// longer holds it (in [0, 1]; 0: only what the events and pending blocks say).
    pub affinity_weight: f64,
    /// Leave the best-scored replica for the one with the least prefill ahead when the
    /// best's is over this many times that (0: never; else >= 1).
    pub divert_ratio: f64,
}

pub mod defaults {
    pub const BALANCE_ABS_THRESHOLD: u32 = 32;
    pub const BALANCE_REL_THRESHOLD: f64 = 1.5;
    pub const LOAD_WEIGHT: f64 = 0.5;
    pub const TOKEN_WEIGHT: f64 = 0.0;
    /// Longer than a request stays in flight under heavy load (`finish` ends its pending blocks
    /// as a rule; this only bounds a finish that never comes).
    pub const PENDING_TTL: f64 = 120.0;
    pub const AFFINITY_WEIGHT: f64 = 1.0;
    /// Chosen on the simulation's tuning seeds (RESULTS, sixth slice): 4 and below give up hit
    /// rate on multi-turn chats, 6 and above rarely divert.
    pub const DIVERT_RATIO: f64 = 5.0;
    /// A new prefix goes where the fewest remembered blocks were last routed among the
    /// replicas with at most this many more requests in flight than the least loaded.
    pub const NEW_PREFIX_SLACK: u32 = 4;
    /// Blocks whose last replica the router remembers, per generation (two are kept: a block
    /// not routed during two generations is forgotten).
    pub const AFFINITY_CAPACITY: usize = 1 << 20;
    /// What a block the replica's host tier holds (not its device cache) counts for against
    /// a device-held one in `cache_aware`'s score: a copy over the host link instead of its
    /// prefill.
    pub const HOST_HIT_WEIGHT: f64 = 0.8;
    /// The same for its disk tier (a file read, then the copy).
    pub const DISK_HIT_WEIGHT: f64 = 0.5;
}

impl RouterConfig {
    pub fn new(num_replicas: usize, block_size: usize, policy: RoutingPolicy) -> Self {
        Self {
            num_replicas,
            block_size,
            policy,
            balance_abs_threshold: defaults::BALANCE_ABS_THRESHOLD,
            balance_rel_threshold: defaults::BALANCE_REL_THRESHOLD,
            load_weight: defaults::LOAD_WEIGHT,
            token_weight: defaults::TOKEN_WEIGHT,
            pending_ttl: defaults::PENDING_TTL,
            affinity_weight: defaults::AFFINITY_WEIGHT,
            divert_ratio: defaults::DIVERT_RATIO,
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.block_size == 0 {
            return bad("block_size must be > 0, got 0".into());
        }
        if self.balance_rel_threshold.is_nan() || self.balance_rel_threshold < 1.0 {
            return bad(format!(
                "balance_rel_threshold must be >= 1, got {}",
                self.balance_rel_threshold
            ));
        }
        if !(0.0..=1.0).contains(&self.load_weight) {
            return bad(format!(
                "load_weight must be in [0, 1], got {}",
                self.load_weight
            ));
        }
        if !(0.0..=1.0).contains(&self.token_weight) {
            return bad(format!(
                "token_weight must be in [0, 1], got {}",
                self.token_weight
            ));
        }
        if !(0.0..=1.0).contains(&self.affinity_weight) {
            return bad(format!(
                "affinity_weight must be in [0, 1], got {}",
                self.affinity_weight
            ));
        }
        if !(self.divert_ratio == 0.0 || self.divert_ratio >= 1.0) {
            return bad(format!(
                "divert_ratio must be 0 (never) or >= 1, got {}",
                self.divert_ratio
            ));
        }
        if self.pending_ttl.is_nan() || self.pending_ttl < 0.0 {
            return bad(format!(
                "pending_ttl must be >= 0, got {}",
                self.pending_ttl
            ));
        }
        Ok(())
    }
}

/// A replica's load as the router knows it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaLoad {
    /// Requests the router sent it that have not finished.
    pub in_flight: u32,
    /// Their prompt tokens its cache did not hold when routed (prefill to do or under way).
    pub uncached_tokens: u64,
    /// From the replica's last load report.
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f64,
}

impl ReplicaLoad {
    /// The queue length the balance rules compare.
    fn queue(&self) -> u32 {
        self.in_flight.max(self.waiting + self.running)
    }
}

/// Per replica counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaCounters {
    pub routed: u64,
    /// Prompt blocks eligible for reuse over the requests routed to it.
    pub query_blocks: u64,
    /// Of those, blocks its cache held when routed (the index's view).
    pub hit_blocks: u64,
}

/// Where a request goes and what the index expected it to find there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub replica: usize,
    pub matched_blocks: usize,
    pub eligible_blocks: usize,
    /// Prompt tokens outside the matched blocks (in flight on the replica until `finish`).
    pub uncached_tokens: usize,
    /// What `finish` is given when the request ends.
    pub ticket: u64,
}

/// A block of requests in flight on a replica.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pending {
    replica: u8,
    /// How many of them hold it.
    count: u32,
    /// The latest of their `pending_ttl` bounds.
    expiry: f64,
}

/// A routed request that has not finished.
#[derive(Debug, Clone)]
struct InFlight {
    replica: usize,
    uncached_tokens: usize,
    /// The blocks it holds pending (emptied when its bound passes).
    pended: Vec<u64>,
    expiry: f64,
}

#[derive(Debug, Clone)]
pub struct Router {
    cfg: RouterConfig,
    index: PrefixIndex,
    /// Blocks of requests in flight: hash -> one entry per replica.
    pending: HashMap<u64, Vec<Pending>, IdBuildHasher>,
    requests: HashMap<u64, InFlight, IdBuildHasher>,
    /// The replica each block was last routed to: this generation's and the previous one's.
    last_routed: [HashMap<u64, u8, IdBuildHasher>; 2],
    /// Per replica, the remembered blocks last routed to it (both generations).
    homed_blocks: Vec<u64>,
    next_ticket: u64,
    alive: u64,
    loads: Vec<ReplicaLoad>,
    counters: Vec<ReplicaCounters>,
    rr_next: usize,
}

impl Router {
    pub fn new(cfg: RouterConfig) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.num_replicas;
        let index = PrefixIndex::new(n)?;
        Ok(Self {
            cfg,
            index,
            pending: HashMap::default(),
            requests: HashMap::default(),
            last_routed: Default::default(),
            homed_blocks: vec![0; n],
            next_ticket: 0,
            alive: if n == 64 { u64::MAX } else { (1u64 << n) - 1 },
            loads: vec![ReplicaLoad::default(); n],
            counters: vec![ReplicaCounters::default(); n],
            rr_next: 0,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Applies batch `seq` of `replica`'s KV events to the index (`PrefixIndex::apply_batch`).
    pub fn apply_batch(
        &mut self,
        replica: usize,
        seq: u64,
        kinds: &[u8],
        starts: &[u32],
        hashes: &[u64],
    ) -> Result<Applied> {
        self.index.apply_batch(replica, seq, kinds, starts, hashes)
    }

    /// `apply_batch` with each record's medium (`PrefixIndex::apply_batch_on`).
    pub fn apply_batch_on(
        &mut self,
        replica: usize,
        seq: u64,
        kinds: &[u8],
        starts: &[u32],
        hashes: &[u64],
        media: &[u8],
    ) -> Result<Applied> {
        self.index
            .apply_batch_on(replica, seq, kinds, starts, hashes, media)
    }

    /// `apply_snapshot` with each hash's medium (`PrefixIndex::apply_snapshot_on`).
    pub fn apply_snapshot_on(
        &mut self,
        replica: usize,
        seq: u64,
        hashes: &[u64],
        media: &[u8],
    ) -> Result<()> {
        self.index.apply_snapshot_on(replica, seq, hashes, media)
    }

    /// Replaces `replica`'s part of the index with its whole cache as of batch `seq`
    /// (`PrefixIndex::apply_snapshot`).
    pub fn apply_snapshot(&mut self, replica: usize, seq: u64, hashes: &[u64]) -> Result<()> {
        self.index.apply_snapshot(replica, seq, hashes)
    }

    /// Forgets `replica`'s part of the index (a restarted replica: batches from 0 again).
    pub fn reset_replica(&mut self, replica: usize) -> Result<()> {
        self.index.reset_replica(replica)
    }

    /// Bounds `replica`'s part of the index to `blocks` (its cache's size; see `PrefixIndex`).
    pub fn set_index_capacity(&mut self, replica: usize, blocks: usize) -> Result<()> {
        self.index.set_capacity(replica, blocks)
    }

    /// Takes a replica in or out of rotation (its index part is kept: see `PrefixIndex`).
    /// Out of rotation, its requests stop counting: a late `finish` for one changes nothing.
    pub fn set_alive(&mut self, replica: usize, alive: bool) -> Result<()> {
        self.index.check_replica(replica)?;
        if alive {
            self.alive |= 1 << replica;
        } else {
            self.alive &= !(1 << replica);
            self.loads[replica].in_flight = 0;
            self.loads[replica].uncached_tokens = 0;
            let gone: Vec<u64> = self
                .requests
                .iter()
                .filter(|(_, q)| q.replica == replica)
                .map(|(&t, _)| t)
                .collect();
            for t in gone {
                let q = self.requests.remove(&t).expect("listed above");
                self.unpend(q.replica, &q.pended);
            }
        }
        Ok(())
    }

    pub fn is_alive(&self, replica: usize) -> bool {
        replica < self.cfg.num_replicas && self.alive & (1 << replica) != 0
    }

    /// The replica's last load report (queue lengths, KV usage in [0, 1]).
    pub fn set_load(
        &mut self,
        replica: usize,
        waiting: u32,
        running: u32,
        kv_usage: f64,
    ) -> Result<()> {
        self.index.check_replica(replica)?;
        let l = &mut self.loads[replica];
        (l.waiting, l.running, l.kv_usage) = (waiting, running, kv_usage);
        Ok(())
    }

    /// The request of `ticket` (its `Decision::ticket`) finished or failed: it no longer
    /// counts on its replica, nor do its blocks (what its prefill stored, the events say). A
    /// ticket already ended, or dropped with its replica by `set_alive`, is ignored; one never
    /// issued is an error.
    pub fn finish(&mut self, ticket: u64) -> Result<()> {
        let Some(q) = self.requests.remove(&ticket) else {
            if ticket < self.next_ticket {
                return Ok(());
            }
            return Err(Error::InvalidArgument(format!(
                "ticket {ticket} was never issued by this router"
            )));
        };
        let l = &mut self.loads[q.replica];
        l.in_flight = l.in_flight.saturating_sub(1);
        l.uncached_tokens = l.uncached_tokens.saturating_sub(q.uncached_tokens as u64);
        self.unpend(q.replica, &q.pended);
        Ok(())
    }

    /// Requests routed and not yet finished (all replicas).
    pub fn num_in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Blocks of requests in flight on `replica` that count as held there at `now`.
    pub fn num_pending(&self, replica: usize, now: f64) -> usize {
        self.pending
            .values()
            .filter(|v| {
                v.iter()
                    .any(|p| p.replica as usize == replica && p.expiry > now)
            })
            .count()
    }

    pub fn load(&self, replica: usize) -> Option<ReplicaLoad> {
        self.loads.get(replica).copied()
    }

    pub fn counters(&self, replica: usize) -> Option<ReplicaCounters> {
        self.counters.get(replica).copied()
    }

    /// Picks a replica for a prompt (`lora_id` 0: the base model; `session`: the sticky key
    /// of the `session` policy) at time `now` (seconds, for the pending blocks' expiry), and
    /// counts it as in flight there until `finish(decision.ticket)`. `excluded`: a mask of replicas not to pick (those a retry
    /// already failed on). Err when no live replica is left.
    pub fn route(
        &mut self,
        tokens: &[TokenId],
        lora_id: u64,
        session: Option<&str>,
        excluded: u64,
        now: f64,
    ) -> Result<Decision> {
        let candidates = self.alive & !excluded;
        if candidates == 0 {
            return Err(Error::InvalidState("no live replica to route to".into()));
        }
        let bs = self.cfg.block_size;
        let eligible = PrefixCache::eligible_blocks(tokens.len(), bs);
        let key = salted_key(0, lora_id);
        let hashes = chain_hashes(&tokens[..eligible * bs], bs, key);
        let matched = self.matched_blocks(&hashes, candidates, now, false);
        let replica = match self.cfg.policy {
            RoutingPolicy::CacheAware => {
                let homed = if self.cfg.affinity_weight > 0.0 {
                    self.matched_blocks(&hashes, candidates, now, true)
                } else {
                    matched.clone()
                };
                let discount = self.tier_discount(&hashes, &matched, candidates, now);
                self.cache_aware(
                    &matched,
                    &homed,
                    &discount,
                    candidates,
                    eligible,
                    tokens.len(),
                )
            }
            RoutingPolicy::LeastLoaded => self.least_loaded(candidates),
            RoutingPolicy::RoundRobin => self.round_robin(candidates),
            RoutingPolicy::Session => match session {
                Some(key) => rendezvous(key, candidates),
                None => self.least_loaded(candidates),
            },
        };
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let expiry = now + self.cfg.pending_ttl;
        let mut pended = Vec::new();
        if self.cfg.affinity_weight > 0.0 {
            self.remember_routed(replica, &hashes);
        }
        if self.cfg.pending_ttl > 0.0 {
            for &h in &hashes {
                let v = self.pending.entry(h).or_default();
                match v.iter_mut().find(|p| p.replica as usize == replica) {
                    Some(p) => {
                        p.count += 1;
                        p.expiry = p.expiry.max(expiry);
                    }
                    None => v.push(Pending {
                        replica: replica as u8,
                        count: 1,
                        expiry,
                    }),
                }
            }
            pended = hashes;
        }
        let uncached = tokens.len().saturating_sub(matched[replica] * bs);
        self.requests.insert(
            ticket,
            InFlight {
                replica,
                uncached_tokens: uncached,
                pended,
                expiry,
            },
        );
        self.loads[replica].in_flight += 1;
        self.loads[replica].uncached_tokens += uncached as u64;
        let c = &mut self.counters[replica];
        c.routed += 1;
        c.query_blocks += eligible as u64;
        c.hit_blocks += matched[replica] as u64;
        Ok(Decision {
            replica,
            matched_blocks: matched[replica],
            eligible_blocks: eligible,
            uncached_tokens: uncached,
            ticket,
        })
    }

    /// Drops the pending blocks of requests in flight past their bound (call now and then;
    /// `route` ignores expired ones anyway). The requests still count as load until `finish`.
    pub fn expire_pending(&mut self, now: f64) {
        let mut expired = Vec::new();
        for q in self.requests.values_mut() {
            if q.expiry <= now && !q.pended.is_empty() {
                expired.push((q.replica, std::mem::take(&mut q.pended)));
            }
        }
        for (replica, hashes) in expired {
            self.unpend(replica, &hashes);
        }
    }

    /// One request in flight on `replica` no longer holds `hashes`.
    fn unpend(&mut self, replica: usize, hashes: &[u64]) {
        for h in hashes {
            if let Some(v) = self.pending.get_mut(h) {
                if let Some(i) = v.iter().position(|p| p.replica as usize == replica) {
                    v[i].count -= 1;
                    if v[i].count == 0 {
                        v.swap_remove(i);
                    }
                }
                if v.is_empty() {
                    self.pending.remove(h);
                }
            }
        }
    }

    /// Records `replica` as where `hashes` last went (the oldest generation is dropped when
    /// this one is full, so the memory stays bounded).
    fn remember_routed(&mut self, replica: usize, hashes: &[u64]) {
        if self.last_routed[0].len() + hashes.len() > defaults::AFFINITY_CAPACITY {
            let young = std::mem::take(&mut self.last_routed[0]);
            let old = std::mem::replace(&mut self.last_routed[1], young);
            for (h, r) in old {
                if !self.last_routed[1].contains_key(&h) {
                    self.homed_blocks[r as usize] -= 1; // forgotten
                }
            }
        }
        for &h in hashes {
            if let Some(prev) = self.last_routed(h) {
                self.homed_blocks[prev] -= 1;
            }
            self.last_routed[0].insert(h, replica as u8);
            self.homed_blocks[replica] += 1;
        }
    }

    /// Remembered blocks last routed to `replica` (the placement key of a new prefix).
    pub fn num_homed_blocks(&self, replica: usize) -> u64 {
        self.homed_blocks.get(replica).copied().unwrap_or(0)
    }

    /// The replica `hash` was last routed to, if remembered.
    fn last_routed(&self, hash: u64) -> Option<usize> {
        self.last_routed
            .iter()
            .find_map(|g| g.get(&hash))
            .map(|&r| r as usize)
    }

    /// Leading blocks of `hashes` each candidate holds (index or pending; with `homed`, also
    /// those it was the last to be routed).
    fn matched_blocks(&self, hashes: &[u64], candidates: u64, now: f64, homed: bool) -> Vec<usize> {
        let mut matched = vec![0; self.cfg.num_replicas];
        let mut live = candidates;
        for (i, &h) in hashes.iter().enumerate() {
            let (host, disk) = self.index.tier_holders(h);
            let mut holders = self.index.holders(h) | host | disk;
            for p in self.pending.get(&h).into_iter().flatten() {
                if p.expiry > now {
                    holders |= 1 << p.replica;
                }
            }
            if homed {
                if let Some(r) = self.last_routed(h) {
                    holders |= 1 << r;
                }
            }
            let dropped = live & !holders;
            for r in bits(dropped) {
                matched[r] = i;
            }
            live &= holders;
            if live == 0 {
                return matched;
            }
        }
        for r in bits(live) {
            matched[r] = hashes.len();
        }
        matched
    }

    /// Per replica, what its matched prefix falls short of as many device blocks: (1 - the
    /// tier's weight) for each block of it only an offload tier holds there.
    fn tier_discount(
        &self,
        hashes: &[u64],
        matched: &[usize],
        candidates: u64,
        now: f64,
    ) -> Vec<f64> {
        let mut discount = vec![0.0; self.cfg.num_replicas];
        if !self.index.has_tier_blocks() {
            return discount;
        }
        let longest = matched.iter().copied().max().unwrap_or(0);
        for (i, &h) in hashes[..longest].iter().enumerate() {
            let (host, disk) = self.index.tier_holders(h);
            let mut device = self.index.holders(h);
            for p in self.pending.get(&h).into_iter().flatten() {
                if p.expiry > now {
                    device |= 1 << p.replica;
                }
            }
            for r in bits((host | disk) & !device & candidates) {
                if i < matched[r] {
                    discount[r] += 1.0
                        - if host & (1 << r) != 0 {
                            defaults::HOST_HIT_WEIGHT
                        } else {
                            defaults::DISK_HIT_WEIGHT
                        };
                }
            }
        }
        discount
    }

    fn cache_aware(
        &mut self,
        matched: &[usize],
        homed: &[usize],
        discount: &[f64],
        candidates: u64,
        eligible: usize,
        prompt_len: usize,
    ) -> usize {
        let queues: Vec<(usize, u32)> = bits(candidates)
            .map(|r| (r, self.loads[r].queue()))
            .collect();
        let max = queues.iter().map(|q| q.1).max().unwrap_or(0);
        let min = queues.iter().map(|q| q.1).min().unwrap_or(0);
        let imbalanced = max - min > self.cfg.balance_abs_threshold
            && max as f64 > self.cfg.balance_rel_threshold * min as f64;
        if imbalanced || eligible == 0 {
            return self.least_loaded(candidates);
        }
        if homed.iter().all(|&m| m == 0) {
            // a new prefix: where the fewest blocks were last sent, then least loaded (all 0
            // without affinity: least loaded alone), among the replicas
            // within `NEW_PREFIX_SLACK` requests in flight of the fewest (a replica that was
            // sent few blocks, say one back in rotation, does not draw every new prefix)
            let homed_blocks = self.homed_blocks.clone(); // at most 64
            let fewest = bits(candidates)
                .map(|r| self.loads[r].in_flight)
                .min()
                .unwrap_or(0);
            return self.pick_in_turn(candidates, |r, l| {
                (
                    l.in_flight > fewest + defaults::NEW_PREFIX_SLACK,
                    homed_blocks[r],
                    least_loaded_key(l),
                )
            });
        }
        let (w, tw, bs) = (
            self.cfg.load_weight,
            self.cfg.token_weight,
            self.cfg.block_size,
        );
        // prefill tokens ahead of this prompt's first token there, its own included
        let cost = |r: usize| {
            self.loads[r].uncached_tokens as f64 + prompt_len.saturating_sub(matched[r] * bs) as f64
        };
        let max_cost = queues.iter().map(|q| cost(q.0)).fold(1.0, f64::max);
        let aw = self.cfg.affinity_weight;
        let score = |r: usize, q: u32| {
            (matched[r] as f64 - discount[r] + aw * homed[r].saturating_sub(matched[r]) as f64)
                / eligible as f64
                - w * (q as f64 / (max as f64 + 1.0) + 0.5 * self.loads[r].kv_usage)
                - tw * cost(r) / max_cost
        };
        let mut best = queues[0].0;
        let mut best_score = f64::NEG_INFINITY;
        for &(r, q) in &queues {
            let s = score(r, q);
            // on a tie, blocks it holds beat blocks it only was sent
            if s > best_score || (s == best_score && matched[r] > matched[best]) {
                (best, best_score) = (r, s);
            }
        }
        if self.cfg.divert_ratio > 0.0 {
            // least prefill ahead; on a tie, the one holding more of the prompt
            let quick = queues
                .iter()
                .map(|q| q.0)
                .min_by(|&a, &b| {
                    cost(a)
                        .total_cmp(&cost(b))
                        .then(matched[b].cmp(&matched[a]))
                })
                .expect("candidates is not empty");
            if cost(best) > self.cfg.divert_ratio * cost(quick) {
                return quick;
            }
        }
        best
    }

    /// Fewest in flight, then shortest reported queue, then lowest KV usage; ties taken in
    /// turn, so an idle cluster spreads new prefixes.
    fn least_loaded(&mut self, candidates: u64) -> usize {
        self.pick_in_turn(candidates, |_, l| least_loaded_key(l))
    }

    /// The candidate with the smallest `key(replica, its load)`; ties taken in turn.
    fn pick_in_turn<K: Ord>(
        &mut self,
        candidates: u64,
        key: impl Fn(usize, &ReplicaLoad) -> K,
    ) -> usize {
        let n = self.cfg.num_replicas;
        let start = self.rr_next;
        let best = (0..n)
            .map(|k| (start + k) % n)
            .filter(|&r| candidates & (1 << r) != 0)
            .min_by_key(|&r| key(r, &self.loads[r]))
            .expect("candidates is not empty");
        self.rr_next = (best + 1) % n;
        best
    }

    fn round_robin(&mut self, candidates: u64) -> usize {
        let n = self.cfg.num_replicas;
        let r = (0..n)
            .map(|k| (self.rr_next + k) % n)
            .find(|&r| candidates & (1 << r) != 0)
            .expect("candidates is not empty");
        self.rr_next = (r + 1) % n;
        r
    }
}

/// `least_loaded`'s order: fewest in flight, then shortest reported queue, then lowest KV usage.
fn least_loaded_key(l: &ReplicaLoad) -> (u32, u32, u64) {
    (
        l.in_flight,
        l.waiting + l.running,
        (l.kv_usage * 1e6) as u64,
    )
}

/// The set bits of `mask`, lowest first.
fn bits(mut mask: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let r = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        Some(r)
    })
}

/// Highest-random-weight choice of `key` among `candidates`: stable while they stay, and a
/// replica leaving moves only the keys it held.
fn rendezvous(key: &str, candidates: u64) -> usize {
    bits(candidates)
        .max_by_key(|&r| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (key, r).hash(&mut h);
            h.finish()
        })
        .expect("candidates is not empty")
}

#[cfg(test)]
mod tests;
