//! The native offload tier's index (`kv_offloading_backend="native"`): which of the host
//! pool's `num_slots` block slots holds which block hash, in LRU order. The workers own the
//! memory (one slot = one block of every layer, contiguous); this side decides which slot
//! each save writes and each load reads, so the pool never holds more than it was sized for.
//!
//! A slot is free, being written (a save in flight: not loadable yet), ready, or pinned by
//! loads in flight (never evicted while read). Ready, unpinned slots sit in the LRU order;
//! a save that needs a slot takes a free one, else evicts the least recently used ready one.
//! A slot whose load failed is forgotten (its hash leaves the index), so the tokens are
//! computed again and never loaded from it twice.
//!
//! Loads are synchronous (`is_async` false): a copy from host memory takes a fraction of a
//! step, so the request is admitted in the step that loads its prefix (the workers copy the
//! blocks in before the forward) rather than parked for a step. `with_async_loads` parks it
//! instead, as the disk tier does.
use std::collections::{BTreeMap, HashMap};

use super::{ConnectorMeta, ConnectorOutput, ConnectorRequest, KvConnector};
use crate::ids::BlockId;
use crate::kv::events::Medium;
use crate::kv::prefix_cache::PrefixCache;
use crate::kv::KvEventLog;

/// Counters of the tier, in blocks (times the block size: tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    pub num_slots: usize,
    /// Slots holding a block (ready or being written).
    pub num_used_slots: usize,
    /// Blocks offered for loading past a device hit, and admissions that found none.
    pub hit_blocks: u64,
    pub missed_blocks: u64,
    pub loaded_blocks: u64,
    pub failed_blocks: u64,
    pub saved_blocks: u64,
    pub evicted_blocks: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    hash: u64,
    /// Holds its block's KV (its save was reported).
    ready: bool,
    /// In the index (false once forgotten after a failed load, or while free).
    live: bool,
    /// Transfers in flight on it (one save, or any number of loads).
    pins: u32,
    /// Its key in `lru` while it sits there.
    tick: u64,
}

#[derive(Debug)]
pub struct OffloadConnector {
    block_size: usize,
    slots: Vec<Slot>,
    index: HashMap<u64, u32>,
    free: Vec<u32>,
    /// tick -> slot, ready unpinned slots only, oldest first.
    lru: BTreeMap<u64, u32>,
    tick: u64,
    /// Slots each transfer in flight pins; loads also remember their device blocks.
    jobs: HashMap<u64, Vec<(BlockId, u32)>>,
    pending: ConnectorMeta,
    stats: OffloadStats,
    /// Loads are asynchronous (the request parks while they run).
    async_loads: bool,
    /// Blocks that became loadable (stored) or left the tier (removed), on the host medium.
    events: KvEventLog,
}

impl OffloadConnector {
    pub fn new(block_size: usize, num_slots: usize) -> Self {
        OffloadConnector {
            block_size,
            slots: vec![Slot::default(); num_slots],
            index: HashMap::new(),
            free: (0..num_slots as u32).rev().collect(),
            lru: BTreeMap::new(),
            tick: 0,
            jobs: HashMap::new(),
            pending: ConnectorMeta::default(),
            stats: OffloadStats {
                num_slots,
                ..OffloadStats::default()
            },
            async_loads: false,
            events: KvEventLog::for_medium(Medium::Host),
        }
    }

    /// Its loads park the request until reported, instead of joining the admitting step.
    pub fn with_async_loads(mut self) -> Self {
        self.async_loads = true;
        self
    }

    /// The ready slot holding `hash`, if any.
    fn ready_slot(&self, hash: u64) -> Option<u32> {
        self.index
            .get(&hash)
            .copied()
            .filter(|&s| self.slots[s as usize].ready)
    }

    fn touch(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if s.pins == 0 && s.ready {
            self.lru.remove(&s.tick);
            self.tick += 1;
            s.tick = self.tick;
            self.lru.insert(self.tick, slot);
        }
    }

    fn pin(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if s.pins == 0 && s.ready {
            self.lru.remove(&s.tick);
        }
        s.pins += 1;
    }

    fn unpin(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        s.pins -= 1;
        if s.pins > 0 {
            return;
        }
        if s.live && s.ready {
            self.tick += 1;
            s.tick = self.tick;
            self.lru.insert(self.tick, slot);
        } else if !s.live {
            *s = Slot::default();
            self.free.push(slot);
        }
    }

    /// Takes the slot out of the index; it returns to the free list once nothing pins it.
    fn forget(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if !s.live {
            return;
        }
        s.live = false;
        if self.index.get(&s.hash) == Some(&slot) {
            self.index.remove(&s.hash);
        }
        if s.ready {
            self.events.removed(s.hash);
        }
        if s.pins == 0 {
            if s.ready {
                self.lru.remove(&s.tick);
            }
            *s = Slot::default();
            self.free.push(slot);
        }
    }

    /// A slot for a new block: a free one, else the least recently used ready one (evicted).
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            return Some(slot);
        }
        let (_, slot) = self.lru.pop_first()?;
        let s = &mut self.slots[slot as usize];
        self.index.remove(&s.hash);
        self.events.removed(s.hash);
        *s = Slot::default();
        self.stats.evicted_blocks += 1;
        Some(slot)
    }

    pub fn stats(&self) -> OffloadStats {
        OffloadStats {
            num_used_slots: self.slots.len() - self.free.len(),
            ..self.stats
        }
    }

    /// The index's consistency (tests): every live slot is indexed under its hash, the LRU
    /// holds exactly the ready unpinned live slots, free slots are the rest.
    pub fn check(&self) -> Result<(), String> {
        let mut in_lru = 0;
        for (i, s) in self.slots.iter().enumerate() {
            let i = i as u32;
            if s.live && self.index.get(&s.hash) != Some(&i) {
                return Err(format!("live slot {i} is not indexed"));
            }
            let should = s.live && s.ready && s.pins == 0;
            if should != (self.lru.get(&s.tick) == Some(&i)) {
                return Err(format!("slot {i}: LRU membership is off"));
            }
            in_lru += should as usize;
            let free = !s.live && s.pins == 0;
            if free != self.free.contains(&i) {
                return Err(format!("slot {i}: free list membership is off"));
            }
        }
        if in_lru != self.lru.len() {
            return Err("LRU holds stale entries".into());
        }
        let pinned: usize = self.jobs.values().map(Vec::len).sum();
        let pins: u32 = self.slots.iter().map(|s| s.pins).sum();
        if pinned != pins as usize {
            return Err(format!("{pinned} pins by transfers, {pins} on slots"));
        }
        Ok(())
    }
}

impl KvConnector for OffloadConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &ConnectorRequest<'_>,
        num_computed: usize,
    ) -> (usize, bool) {
        let bs = self.block_size;
        let eligible =
            PrefixCache::eligible_blocks(req.tokens.len(), bs).min(req.block_hashes.len());
        let start = num_computed / bs;
        let hits = req.block_hashes[start.min(eligible)..eligible]
            .iter()
            .take_while(|&&h| self.ready_slot(h).is_some())
            .count();
        if hits == 0 {
            self.stats.missed_blocks += eligible.saturating_sub(start) as u64;
        }
        (hits * bs, self.async_loads)
    }

    fn update_state_after_alloc(
        &mut self,
        req: &ConnectorRequest<'_>,
        blocks: &[BlockId],
        num_external_tokens: usize,
    ) {
        let n = num_external_tokens / self.block_size;
        let first = blocks.len() - n;
        let mut pinned = Vec::with_capacity(n);
        for (i, &block) in blocks.iter().enumerate().skip(first) {
            let hash = req.block_hashes[i];
            let slot = self
                .ready_slot(hash)
                .expect("matched blocks stay ready until the load that reads them");
            self.pin(slot);
            self.pending.push_load(req.job, block, slot, hash);
            pinned.push((block, slot));
        }
        self.stats.hit_blocks += n as u64;
        self.jobs.insert(req.job, pinned);
    }

    fn build_connector_meta(&mut self, meta: &mut ConnectorMeta) {
        self.pending.drain_into(meta);
    }

    fn request_finished(&mut self, req: &ConnectorRequest<'_>, blocks: &[BlockId]) -> bool {
        let mut saving = Vec::new();
        for (&block, &hash) in blocks.iter().zip(req.block_hashes) {
            if let Some(&slot) = self.index.get(&hash) {
                self.touch(slot);
                continue;
            }
            let Some(slot) = self.take_slot() else {
                break; // every slot is in flight: the rest is not kept
            };
            self.slots[slot as usize] = Slot {
                hash,
                ready: false,
                live: true,
                pins: 1,
                tick: 0,
            };
            self.index.insert(hash, slot);
            self.pending.push_save(req.job, block, slot, hash);
            saving.push((block, slot));
        }
        if saving.is_empty() {
            return false;
        }
        self.stats.saved_blocks += saving.len() as u64;
        self.jobs.insert(req.job, saving);
        true
    }

    fn update_connector_output(&mut self, out: &ConnectorOutput<'_>) {
        for job in out.finished_sending {
            for (_, slot) in self.jobs.remove(job).unwrap_or_default() {
                let s = &mut self.slots[slot as usize];
                s.ready = s.live;
                if s.ready {
                    self.events.stored_in_tier(s.hash);
                }
                self.unpin(slot);
            }
        }
        for job in out.finished_recving {
            for (block, slot) in self.jobs.remove(job).unwrap_or_default() {
                if out.invalid_blocks.contains(&block) {
                    self.stats.failed_blocks += 1;
                    self.forget(slot);
                } else {
                    self.stats.loaded_blocks += 1;
                }
                self.unpin(slot);
            }
        }
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        Some(self.stats())
    }

    fn kv_events_mut(&mut self) -> Option<&mut KvEventLog> {
        Some(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<'a>(job: u64, tokens: &'a [u32], hashes: &'a [u64]) -> ConnectorRequest<'a> {
        ConnectorRequest {
            id: "r",
            job,
            tokens,
            block_hashes: hashes,
        }
    }

    /// Saves `hashes` from device blocks 0.. under `job` and reports the save done.
    fn save(c: &mut OffloadConnector, job: u64, hashes: &[u64]) {
        let tokens = vec![1; hashes.len() * 2];
        let blocks: Vec<BlockId> = (0..hashes.len() as u32).collect();
        c.request_finished(&request(job, &tokens, hashes), &blocks);
        c.update_connector_output(&ConnectorOutput {
            finished_sending: &[job],
            ..Default::default()
        });
    }

    #[test]
    fn saved_blocks_match_after_the_save_is_reported_and_not_before() {
        let mut c = OffloadConnector::new(2, 4);
        let tokens = [1; 7];
        let hashes = [10, 11, 12];
        assert!(c.request_finished(&request(1, &tokens, &hashes), &[5, 6, 7]));
        assert_eq!(
            c.get_num_new_matched_tokens(&request(0, &tokens, &hashes), 0),
            (0, false)
        );
        let mut meta = ConnectorMeta::default();
        c.build_connector_meta(&mut meta);
        assert_eq!(meta.save_blocks, vec![5, 6, 7]);
        assert_eq!(meta.save_jobs, vec![1, 1, 1]);
        c.update_connector_output(&ConnectorOutput {
            finished_sending: &[1],
            ..Default::default()
        });
        // 7 tokens: the last is always computed, so 3 full blocks are eligible.
        assert_eq!(
            c.get_num_new_matched_tokens(&request(0, &tokens, &hashes), 2),
            (4, false)
        );
        c.check().unwrap();
    }

    #[test]
    fn the_pool_evicts_its_least_recently_used_block_and_never_grows() {
        let mut c = OffloadConnector::new(2, 2);
        save(&mut c, 1, &[10]);
        save(&mut c, 2, &[11]);
        save(&mut c, 3, &[10]); // already there: touched, not saved again
        save(&mut c, 4, &[12]); // evicts 11, the least recently used
        assert!(c.index.contains_key(&10) && c.index.contains_key(&12));
        assert!(!c.index.contains_key(&11));
        let s = c.stats();
        assert_eq!(
            (s.num_used_slots, s.saved_blocks, s.evicted_blocks),
            (2, 3, 1)
        );
        c.check().unwrap();
    }

    #[test]
    fn a_slot_being_loaded_is_never_evicted() {
        let mut c = OffloadConnector::new(2, 1);
        save(&mut c, 1, &[10]);
        let tokens = [1; 3];
        let r = request(2, &tokens, &[10]);
        assert_eq!(c.get_num_new_matched_tokens(&r, 0), (2, false));
        c.update_state_after_alloc(&r, &[3], 2);
        // The only slot is pinned by the load: nothing can be saved.
        assert!(!c.request_finished(&request(3, &tokens, &[20]), &[4]));
        c.update_connector_output(&ConnectorOutput {
            finished_recving: &[2],
            ..Default::default()
        });
        assert!(c.request_finished(&request(4, &tokens, &[20]), &[4]));
        c.check().unwrap();
    }

    #[test]
    fn a_failed_load_forgets_its_entry() {
        let mut c = OffloadConnector::new(2, 4);
        save(&mut c, 1, &[10, 11]);
        let tokens = [1; 5];
        let hashes = [10, 11];
        let r = request(2, &tokens, &hashes);
        assert_eq!(c.get_num_new_matched_tokens(&r, 0), (4, false));
        c.update_state_after_alloc(&r, &[7, 8], 4);
        c.update_connector_output(&ConnectorOutput {
            finished_recving: &[2],
            invalid_blocks: &[8],
            ..Default::default()
        });
        assert_eq!(c.get_num_new_matched_tokens(&r, 0), (2, false));
        let s = c.stats();
        assert_eq!(
            (s.loaded_blocks, s.failed_blocks, s.num_used_slots),
            (1, 1, 1)
        );
        c.check().unwrap();
    }
}

#[cfg(test)]
mod event_tests {
    use super::*;
    use crate::connector::ConnectorOutput;
    use crate::kv::KvEventKind;

    fn save(c: &mut OffloadConnector, job: u64, hashes: &[u64]) {
        let tokens = vec![1; hashes.len() * 2];
        let blocks: Vec<BlockId> = (0..hashes.len() as u32).collect();
        let req = ConnectorRequest {
            id: "r",
            job,
            tokens: &tokens,
            block_hashes: hashes,
        };
        c.request_finished(&req, &blocks);
        c.update_connector_output(&ConnectorOutput {
            finished_sending: &[job],
            ..Default::default()
        });
    }

    #[test]
    fn the_host_tier_publishes_its_saves_and_evictions_on_the_host_medium() {
        let mut c = OffloadConnector::new(2, 2);
        c.kv_events_mut().unwrap().set_enabled(true, 2);
        save(&mut c, 1, &[10, 11]);
        save(&mut c, 2, &[12]); // evicts the least recently used: 10
        let b = c.kv_events_mut().unwrap().drain();
        let (s, r) = (KvEventKind::Stored as u8, KvEventKind::Removed as u8);
        assert_eq!(b.kinds, vec![s, r, s]);
        assert_eq!(b.hashes, vec![10, 11, 10, 12]);
        assert!(b.media.iter().all(|&m| m == Medium::Host as u8));
    }
}
