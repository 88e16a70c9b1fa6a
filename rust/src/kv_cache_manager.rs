//! The KV-cache memory manager: device and host block pools, per-sequence block tables,
//! fork / copy-on-write, swap, and the prefix cache (SPEC §3, ARCHITECTURE §1).
//!
//! Every fallible operation validates everything before it mutates anything, so an `Err` (or an
//! `Ok(false)` / `Ok(None)` "not enough blocks" answer) leaves the manager exactly as it was.
use std::collections::{HashMap, HashSet};

use crate::block_pool::BlockPool;
pub use crate::block_pool::BlockState;
use crate::block_table::blocks_for;
pub use crate::block_table::{BlockTable, Location};
pub use crate::error::{Error, Result};
use crate::prefix_cache::{extend_chain, hash_block, IdBuildHasher, PrefixCache, ROOT_HASH};
pub use crate::prefix_cache::{PrefixCacheStats, PrefixHit};
pub use crate::{BlockId, SeqId, TokenId};

#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Token slots per block.
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    /// Host (swap space) blocks.
    pub num_cpu_blocks: usize,
    /// Fraction of the device pool kept free at admission, in [0, 1).
    pub watermark: f64,
    pub enable_prefix_caching: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 0,
            num_cpu_blocks: 0,
            watermark: 0.01,
            enable_prefix_caching: true,
        }
    }
}

impl CacheConfig {
    /// Defaults (watermark 0.01, prefix caching on) with the given sizes.
    pub fn new(block_size: usize, num_gpu_blocks: usize, num_cpu_blocks: usize) -> Self {
        Self {
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            ..Self::default()
        }
    }
}

/// Answer of the admission checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocStatus {
    /// Fits now.
    Ok,
    /// Does not fit now, may fit once blocks are freed.
    Later,
    /// Can never fit in this pool.
    Never,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CacheStats {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub num_cpu_blocks: usize,
    /// Free device blocks, cached-evictable ones included.
    pub num_free_gpu_blocks: usize,
    pub num_free_cpu_blocks: usize,
    /// Device blocks with ref count 0 still holding cached contents.
    pub num_cached_gpu_blocks: usize,
    /// Device blocks registered in the prefix cache (in use or evictable).
    pub num_registered_blocks: usize,
    pub num_sequences: usize,
    pub num_swapped_sequences: usize,
    /// Fraction of device blocks in use.
    pub gpu_usage: f64,
    /// Fraction of host blocks in use.
    pub cpu_usage: f64,
    pub watermark_blocks: usize,
    pub prefix_cache: PrefixCacheStats,
}

#[derive(Debug, Clone)]
pub struct KvCacheManager {
    config: CacheConfig,
    gpu: BlockPool,
    cpu: BlockPool,
    prefix_cache: PrefixCache,
    tables: HashMap<SeqId, BlockTable, IdBuildHasher>,
    watermark_blocks: usize,
}

/// Takes a device block: an uncached free one if any, else evicts the LRU cached one.
fn take_device_block(pool: &mut BlockPool, cache: &mut PrefixCache) -> Option<BlockId> {
    if let Some(block) = pool.pop_free() {
        return Some(block);
    }
    let block = pool.pop_lru()?;
    cache.evict(block);
    Some(block)
}

/// Drops one reference to a device block; at zero a registered block stays cached.
fn release_device_block(pool: &mut BlockPool, cache: &PrefixCache, block: BlockId) {
    pool.decref(block, cache.is_registered(block));
}

fn usage_of(pool: &BlockPool) -> f64 {
    if pool.num_blocks() == 0 {
        0.0
    } else {
        pool.num_in_use() as f64 / pool.num_blocks() as f64
    }
}

/// Error for a free count that a prior check guaranteed (only reachable through a bug).
fn broken_free_count(pool: &str) -> Error {
    Error::InvalidState(format!(
        "{pool} pool ran dry after its free count was checked"
    ))
}

impl KvCacheManager {
    pub fn new(config: CacheConfig) -> Result<Self> {
        if config.block_size == 0 {
            return Err(Error::InvalidArgument(
                "block_size must be > 0, got 0".into(),
            ));
        }
        if !(0.0..1.0).contains(&config.watermark) {
            return Err(Error::InvalidArgument(format!(
                "watermark must be in [0, 1), got {}",
                config.watermark
            )));
        }
        let gpu = BlockPool::new(config.num_gpu_blocks)?;
        let cpu = BlockPool::new(config.num_cpu_blocks)?;
        let prefix_cache = PrefixCache::new(config.num_gpu_blocks, config.enable_prefix_caching);
        let watermark_blocks = (config.watermark * config.num_gpu_blocks as f64) as usize;
        Ok(Self {
            config,
            gpu,
            cpu,
            prefix_cache,
            tables: HashMap::default(),
            watermark_blocks,
        })
    }

    // ---- inspection -------------------------------------------------------------------------

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }

    pub fn num_gpu_blocks(&self) -> usize {
        self.gpu.num_blocks()
    }

    pub fn num_cpu_blocks(&self) -> usize {
        self.cpu.num_blocks()
    }

    /// Free device blocks, cached-evictable ones included.
    pub fn num_free_gpu_blocks(&self) -> usize {
        self.gpu.num_free()
    }

    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }

    /// Free device blocks holding nothing cached (taken before any cached block is evicted).
    pub fn num_uncached_free_gpu_blocks(&self) -> usize {
        self.gpu.num_uncached_free()
    }

    /// Device blocks with ref count 0 whose contents are still cached.
    pub fn num_cached_gpu_blocks(&self) -> usize {
        self.gpu.num_cached()
    }

    pub fn num_sequences(&self) -> usize {
        self.tables.len()
    }

    /// Fraction of device blocks in use (cached-evictable blocks count as free).
    pub fn usage(&self) -> f64 {
        usage_of(&self.gpu)
    }

    /// Fraction of host blocks in use.
    pub fn cpu_usage(&self) -> f64 {
        usage_of(&self.cpu)
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.tables.contains_key(&seq)
    }

    /// True when the sequence exists and its blocks are on the host.
    pub fn is_swapped(&self, seq: SeqId) -> bool {
        self.tables
            .get(&seq)
            .is_some_and(|t| t.location == Location::Host)
    }

    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.table(seq)?.blocks)
    }

    pub fn table(&self, seq: SeqId) -> Result<&BlockTable> {
        self.tables.get(&seq).ok_or(Error::UnknownSequence(seq))
    }

    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.tables.keys().copied()
    }

    /// Ref count of a device block (`None` outside the pool).
    pub fn gpu_ref_count(&self, block: BlockId) -> Option<u32> {
        self.gpu.ref_count(block)
    }

    /// Ref count of a host block (`None` outside the pool).
    pub fn cpu_ref_count(&self, block: BlockId) -> Option<u32> {
        self.cpu.ref_count(block)
    }

    pub fn gpu_block_state(&self, block: BlockId) -> Option<BlockState> {
        self.gpu.state(block)
    }

    /// Hash a device block is registered under in the prefix cache.
    pub fn block_hash(&self, block: BlockId) -> Option<u64> {
        self.prefix_cache.block_hash(block)
    }

    /// Cached device blocks in eviction order (first evicted first).
    pub fn evictable_blocks(&self) -> Vec<BlockId> {
        self.gpu.lru_order()
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.prefix_cache.stats()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            block_size: self.config.block_size,
            num_gpu_blocks: self.gpu.num_blocks(),
            num_cpu_blocks: self.cpu.num_blocks(),
            num_free_gpu_blocks: self.gpu.num_free(),
            num_free_cpu_blocks: self.cpu.num_free(),
            num_cached_gpu_blocks: self.gpu.num_cached(),
            num_registered_blocks: self.prefix_cache.len(),
            num_sequences: self.tables.len(),
            num_swapped_sequences: self
                .tables
                .values()
                .filter(|t| t.location == Location::Host)
                .count(),
            gpu_usage: self.usage(),
            cpu_usage: self.cpu_usage(),
            watermark_blocks: self.watermark_blocks,
            prefix_cache: self.prefix_cache.stats(),
        }
    }

    // ---- admission --------------------------------------------------------------------------

    /// OK / LATER / NEVER for a new sequence of `num_tokens` tokens with no prefix hit.
    pub fn can_allocate(&self, num_tokens: usize) -> AllocStatus {
        let needed = blocks_for(num_tokens, self.config.block_size);
        self.admission(needed, needed)
    }

    /// Like `can_allocate`, but counting only the blocks `allocate(hit, num_slots)` would take
    /// from the free pool (fresh blocks plus cached hit blocks it revives).
    pub fn can_allocate_with_prefix(&self, hit: &PrefixHit, num_slots: usize) -> AllocStatus {
        let total = blocks_for(num_slots, self.config.block_size);
        self.admission(total, self.num_blocks_to_allocate(hit, num_slots))
    }

    /// Free blocks `allocate(hit, num_slots)` consumes.
    pub fn num_blocks_to_allocate(&self, hit: &PrefixHit, num_slots: usize) -> usize {
        let total = blocks_for(num_slots, self.config.block_size);
        let revived = hit
            .blocks
            .iter()
            .filter(|&&b| self.gpu.state(b) == Some(BlockState::Cached))
            .count();
        total.saturating_sub(hit.blocks.len()) + revived
    }

    fn admission(&self, total_blocks: usize, free_blocks_taken: usize) -> AllocStatus {
        if total_blocks > self.gpu.num_blocks() - self.watermark_blocks {
            AllocStatus::Never
        } else if self.gpu.num_free() < free_blocks_taken + self.watermark_blocks {
            AllocStatus::Later
        } else {
            AllocStatus::Ok
        }
    }

    /// Conservative: one block per running sequence (a new block or a CoW copy) plus the blocks
    /// its lookahead slots may spill into.
    pub fn can_append_slots(&self, num_running_seqs: usize, num_lookahead_slots: usize) -> bool {
        let per_seq = 1 + blocks_for(num_lookahead_slots, self.config.block_size);
        self.gpu.num_free() >= num_running_seqs.saturating_mul(per_seq)
    }

    // ---- prefix cache -----------------------------------------------------------------------

    /// Read-only prefix query: no counters move.
    pub fn find_prefix(&self, tokens: &[TokenId], extra_key: u64) -> PrefixHit {
        self.prefix_cache
            .find(tokens, self.config.block_size, extra_key)
    }

    /// Prefix query for admission: counts one query and its hit / missed blocks.
    pub fn lookup_prefix(&mut self, tokens: &[TokenId], extra_key: u64) -> PrefixHit {
        let hit = self.find_prefix(tokens, extra_key);
        self.prefix_cache
            .record(tokens.len(), self.config.block_size, hit.blocks.len());
        hit
    }

    /// Registers every block fully inside `tokens[..num_computed]` not offered yet. Returns how
    /// many blocks were newly registered (a hash already mapped to another block is left as is).
    pub fn cache_full_blocks(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        num_computed: usize,
        extra_key: u64,
    ) -> Result<usize> {
        let bs = self.config.block_size;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence(seq))?;
        if table.location == Location::Host {
            return Err(Error::InvalidState(format!(
                "sequence {seq} is swapped out"
            )));
        }
        if num_computed > tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "num_computed_tokens {num_computed} exceeds the {} tokens given",
                tokens.len()
            )));
        }
        let full = num_computed / bs;
        if full > table.len() {
            return Err(Error::InvalidArgument(format!(
                "num_computed_tokens {num_computed} exceeds the {} slots of sequence {seq}",
                table.capacity(bs)
            )));
        }
        if !self.prefix_cache.is_enabled() || full <= table.num_registered {
            return Ok(0);
        }
        if full == table.num_registered + 1 && table.hashes.len() + 1 == full {
            // Decode's common case: exactly one block just filled; hash it straight from its
            // parent and register it (no chain loop).
            let i = full - 1;
            let parent = table.hashes.last().copied().unwrap_or(ROOT_HASH);
            let hash = hash_block(parent, &tokens[i * bs..full * bs], extra_key);
            table.hashes.push(hash);
            table.num_registered = full;
            return Ok(self.prefix_cache.register(table.blocks[i], hash) as usize);
        }
        extend_chain(&mut table.hashes, tokens, bs, extra_key, full);
        let mut registered = 0;
        for i in table.num_registered..full {
            if self.prefix_cache.register(table.blocks[i], table.hashes[i]) {
                registered += 1;
            }
        }
        table.num_registered = full;
        Ok(registered)
    }

    /// `cache_full_blocks` for several sequences, in order, in two passes: first every
    /// sequence whose only new full block is the next one gets that block's hash computed
    /// and chained (and its map entry prefetched), then all registrations run back to back,
    /// so the cache misses of consecutive registrations overlap. Items that are not that
    /// simple case take `cache_full_blocks` itself, in their turn. Each item is
    /// (sequence, its tokens, num_computed, extra_key); a sequence appears at most once.
    /// Returns how many blocks were newly registered.
    pub fn cache_full_blocks_batch(
        &mut self,
        items: &[(SeqId, &[TokenId], usize, u64)],
    ) -> Result<usize> {
        let bs = self.config.block_size;
        let enabled = self.prefix_cache.is_enabled();
        // (block, hash) staged by the first pass; `None`: take the general path.
        let mut staged: Vec<Option<(BlockId, u64)>> = Vec::with_capacity(items.len());
        for &(seq, tokens, num_computed, extra_key) in items {
            let full = num_computed / bs;
            let simple = match self.tables.get_mut(&seq) {
                Some(table)
                    if enabled
                        && table.location == Location::Device
                        && num_computed <= tokens.len()
                        && full <= table.len()
                        && full == table.num_registered + 1
                        && table.hashes.len() + 1 == full =>
                {
                    let i = full - 1;
                    let parent = table.hashes.last().copied().unwrap_or(ROOT_HASH);
                    let hash = hash_block(parent, &tokens[i * bs..full * bs], extra_key);
                    table.hashes.push(hash);
                    table.num_registered = full;
                    Some((table.blocks[i], hash))
                }
                _ => None,
            };
            if let Some((block, _)) = simple {
                self.prefix_cache.prefetch_block(block);
            }
            staged.push(simple);
        }
        let mut registered = 0;
        for (&(seq, tokens, num_computed, extra_key), st) in items.iter().zip(staged) {
            registered += match st {
                Some((block, hash)) => self.prefix_cache.register(block, hash) as usize,
                None => self.cache_full_blocks(seq, tokens, num_computed, extra_key)?,
            };
        }
        Ok(registered)
    }

    /// Marks the start of a scheduling step: `forget_step_registrations` takes back what the
    /// prefix cache registers from here on.
    pub fn begin_step(&mut self) {
        self.prefix_cache.start_journal();
    }

    /// Takes back the prefix-cache registrations made since `begin_step`, for a step whose
    /// computation failed: those blocks never received their KV. Call it once the step's
    /// sequences have released them; a block still held keeps its registration (an error,
    /// as nothing but the failed step's own sequences can hold it). Returns how many
    /// registrations were dropped.
    pub fn forget_step_registrations(&mut self) -> Result<usize> {
        let mut dropped = 0;
        for block in self.prefix_cache.take_journal() {
            match self.gpu.state(block) {
                Some(BlockState::Cached) => {
                    self.prefix_cache.unregister(block);
                    self.gpu.uncache(block);
                    dropped += 1;
                }
                Some(BlockState::InUse) if self.prefix_cache.is_registered(block) => {
                    return Err(Error::InvalidState(format!(
                        "block {block} registered by the discarded step is still in use"
                    )));
                }
                _ => {}
            }
        }
        Ok(dropped)
    }

    /// Drops every prefix-cache registration; cached-evictable blocks become plain free blocks.
    /// Hit / miss / eviction counters are kept.
    pub fn reset_prefix_cache(&mut self) {
        self.prefix_cache.clear();
        for block in self.gpu.lru_order() {
            self.gpu.uncache(block);
        }
    }

    // ---- allocation -------------------------------------------------------------------------

    fn validate_hit(&self, hit: &PrefixHit) -> Result<()> {
        let bs = self.config.block_size;
        if hit.blocks.len() > hit.hashes.len() || hit.num_cached_tokens != hit.blocks.len() * bs {
            return Err(Error::InvalidArgument(format!(
                "malformed prefix hit: {} blocks, {} hashes, {} cached tokens",
                hit.blocks.len(),
                hit.hashes.len(),
                hit.num_cached_tokens
            )));
        }
        for (i, (&block, &hash)) in hit.blocks.iter().zip(&hit.hashes).enumerate() {
            if self.prefix_cache.get(hash) != Some(block) {
                return Err(Error::InvalidArgument(format!(
                    "stale prefix hit: block {block} no longer caches prefix block {i}"
                )));
            }
        }
        Ok(())
    }

    /// New table = the hit's blocks (ref +1, revived when cached) + fresh blocks up to
    /// `ceil(num_slots / block_size)`. `Ok(false)` and no change when the free blocks (minus the
    /// watermark if asked) do not suffice.
    pub fn allocate(
        &mut self,
        seq: SeqId,
        hit: &PrefixHit,
        num_slots: usize,
        apply_watermark: bool,
    ) -> Result<bool> {
        self.allocate_impl(seq, hit, None, num_slots, apply_watermark)
    }

    /// `allocate` taking the hit by value: its hash chain moves into the new table instead of
    /// being copied (the scheduler's admission path).
    pub fn allocate_owned(
        &mut self,
        seq: SeqId,
        mut hit: PrefixHit,
        num_slots: usize,
        apply_watermark: bool,
    ) -> Result<bool> {
        if self.tables.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        self.validate_hit(&hit)?;
        let hashes = std::mem::take(&mut hit.hashes);
        self.allocate_impl(seq, &hit, Some(hashes), num_slots, apply_watermark)
    }

    /// `owned_hashes`: the hit's validated hash chain, moved in (else `hit` is validated and
    /// its chain copied).
    fn allocate_impl(
        &mut self,
        seq: SeqId,
        hit: &PrefixHit,
        owned_hashes: Option<Vec<u64>>,
        num_slots: usize,
        apply_watermark: bool,
    ) -> Result<bool> {
        if owned_hashes.is_none() {
            if self.tables.contains_key(&seq) {
                return Err(Error::DuplicateSequence(seq));
            }
            self.validate_hit(hit)?;
        }
        let total = blocks_for(num_slots, self.config.block_size);
        if hit.blocks.len() > total {
            return Err(Error::InvalidArgument(format!(
                "num_slots {num_slots} is fewer than the {} cached tokens of the prefix hit",
                hit.num_cached_tokens
            )));
        }
        let needed = self.num_blocks_to_allocate(hit, num_slots);
        let reserve = if apply_watermark {
            self.watermark_blocks
        } else {
            0
        };
        if self.gpu.num_free() < needed + reserve {
            return Ok(false);
        }
        // Headroom for the decode blocks to come (a full-table regrowth per doubling is a
        // copy of the whole table).
        let mut blocks = Vec::with_capacity(total + total / 2 + 2);
        // Hit blocks first: once revived they are off the LRU list, so the fresh allocations
        // below cannot evict them.
        for &block in &hit.blocks {
            self.gpu.incref(block);
            blocks.push(block);
        }
        for _ in hit.blocks.len()..total {
            let block = take_device_block(&mut self.gpu, &mut self.prefix_cache)
                .ok_or_else(|| broken_free_count("device"))?;
            blocks.push(block);
        }
        let hashes = if self.prefix_cache.is_enabled() {
            match owned_hashes {
                Some(h) => h,
                None => {
                    let mut h = Vec::with_capacity((total + total / 2 + 2).max(hit.hashes.len()));
                    h.extend_from_slice(&hit.hashes);
                    h
                }
            }
        } else {
            Vec::new()
        };
        self.tables
            .insert(seq, BlockTable::new(blocks, hashes, hit.blocks.len()));
        Ok(true)
    }

    /// Lookup (counted) + allocate in one call. `num_slots` defaults to every token; the hit is
    /// cut to the blocks inside `num_slots`. Returns the number of cached (reused) tokens, or
    /// `None` (no change) when the blocks do not suffice.
    pub fn allocate_prompt(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        num_slots: Option<usize>,
        extra_key: u64,
        apply_watermark: bool,
    ) -> Result<Option<usize>> {
        if self.tables.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        let num_slots = num_slots.unwrap_or(tokens.len());
        let mut hit = self.lookup_prefix(tokens, extra_key);
        let keep = hit.blocks.len().min(num_slots / self.config.block_size);
        hit.blocks.truncate(keep);
        hit.num_cached_tokens = keep * self.config.block_size;
        let cached = hit.num_cached_tokens;
        Ok(self
            .allocate(seq, &hit, num_slots, apply_watermark)?
            .then_some(cached))
    }

    /// Grows the table to cover `num_slots` slots. Every existing block that slots
    /// `[first_new_slot, num_slots)` write into and that is shared is copied first; the
    /// (src, dst) pairs are returned. `None` and no change when out of blocks.
    pub fn append_slots(
        &mut self,
        seq: SeqId,
        first_new_slot: usize,
        num_slots: usize,
    ) -> Result<Option<Vec<(BlockId, BlockId)>>> {
        let bs = self.config.block_size;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence(seq))?;
        if table.location == Location::Host {
            return Err(Error::InvalidState(format!(
                "sequence {seq} is swapped out"
            )));
        }
        if first_new_slot > num_slots {
            return Err(Error::InvalidArgument(format!(
                "first_new_slot {first_new_slot} is past num_slots {num_slots}"
            )));
        }
        let target = blocks_for(num_slots, bs);
        let written = (first_new_slot / bs)..target.min(table.len());
        let gpu = &mut self.gpu;
        let num_copies = table.blocks[written.clone()]
            .iter()
            .filter(|&&b| gpu.ref_count(b).unwrap_or(0) > 1)
            .count();
        let grow = target.saturating_sub(table.len());
        if gpu.num_free() < num_copies + grow {
            return Ok(None);
        }
        let mut copies = Vec::with_capacity(num_copies);
        for i in written {
            let src = table.blocks[i];
            if gpu.ref_count(src).unwrap_or(0) > 1 {
                let dst = take_device_block(gpu, &mut self.prefix_cache)
                    .ok_or_else(|| broken_free_count("device"))?;
                // ref > 1, so this never releases `src`.
                gpu.decref(src, true);
                table.blocks[i] = dst;
                copies.push((src, dst));
            }
        }
        for _ in 0..grow {
            let block = take_device_block(gpu, &mut self.prefix_cache)
                .ok_or_else(|| broken_free_count("device"))?;
            table.blocks.push(block);
        }
        Ok(Some(copies))
    }

    /// Appends one fresh device block to a device-resident table and returns it: what
    /// `append_slots(seq, n, n + 1)` does when `n` is exactly the table's capacity (nothing
    /// existing is written, so nothing is copied), in one table lookup. `None` and no change
    /// when no device block is free.
    pub fn append_fresh_block(&mut self, seq: SeqId) -> Result<Option<BlockId>> {
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence(seq))?;
        if table.location == Location::Host {
            return Err(Error::InvalidState(format!(
                "sequence {seq} is swapped out"
            )));
        }
        let Some(block) = take_device_block(&mut self.gpu, &mut self.prefix_cache) else {
            return Ok(None);
        };
        table.blocks.push(block);
        Ok(Some(block))
    }

    /// The child shares every block of the parent (ref +1) and its hash chain.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        let table = self
            .tables
            .get(&parent)
            .ok_or(Error::UnknownSequence(parent))?;
        if parent == child || self.tables.contains_key(&child) {
            return Err(Error::DuplicateSequence(child));
        }
        let table = table.clone();
        let pool = match table.location {
            Location::Device => &mut self.gpu,
            Location::Host => &mut self.cpu,
        };
        for &block in &table.blocks {
            pool.incref(block);
        }
        self.tables.insert(child, table);
        Ok(())
    }

    /// Releases the sequence's table, in whichever pool it is. Device blocks reaching ref 0 go
    /// to the free stack, or, when registered, to the LRU tail, deepest block first.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let table = self
            .tables
            .remove(&seq)
            .ok_or(Error::UnknownSequence(seq))?;
        match table.location {
            Location::Device => {
                for &block in table.blocks.iter().rev() {
                    release_device_block(&mut self.gpu, &self.prefix_cache, block);
                }
            }
            Location::Host => {
                for &block in table.blocks.iter().rev() {
                    self.cpu.decref(block, false);
                }
            }
        }
        Ok(())
    }

    // ---- swap -------------------------------------------------------------------------------

    /// Distinct blocks of a group, in order of first appearance, after checking that every
    /// sequence exists, is listed once, and lives in `location`.
    fn group_blocks(&self, seqs: &[SeqId], location: Location) -> Result<Vec<BlockId>> {
        let mut listed = HashSet::with_capacity_and_hasher(seqs.len(), IdBuildHasher::default());
        let mut seen = HashSet::with_hasher(IdBuildHasher::default());
        let mut distinct = Vec::new();
        for &seq in seqs {
            let table = self.tables.get(&seq).ok_or(Error::UnknownSequence(seq))?;
            if !listed.insert(seq) {
                return Err(Error::InvalidArgument(format!(
                    "sequence id {seq} listed twice"
                )));
            }
            if table.location != location {
                let what = match location {
                    Location::Device => "is swapped out",
                    Location::Host => "is not swapped out",
                };
                return Err(Error::InvalidState(format!("sequence {seq} {what}")));
            }
            for &block in &table.blocks {
                if seen.insert(block) {
                    distinct.push(block);
                }
            }
        }
        Ok(distinct)
    }

    /// Whether the host pool can take the group's distinct device blocks (errors for unknown,
    /// repeated or already swapped-out sequences).
    pub fn check_swap_out(&self, seqs: &[SeqId]) -> Result<bool> {
        Ok(self.group_blocks(seqs, Location::Device)?.len() <= self.cpu.num_free())
    }

    /// `check_swap_out`, with any error answered `false`.
    pub fn can_swap_out(&self, seqs: &[SeqId]) -> bool {
        self.check_swap_out(seqs).unwrap_or(false)
    }

    /// Moves the group's device blocks to host blocks, each distinct block once (sharing kept),
    /// and releases the device blocks. Returns the (device, host) copy pairs.
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let distinct = self.group_blocks(seqs, Location::Device)?;
        if distinct.len() > self.cpu.num_free() {
            return Err(Error::OutOfHostBlocks {
                needed: distinct.len(),
                free: self.cpu.num_free(),
            });
        }
        let mut mapping: HashMap<BlockId, BlockId, IdBuildHasher> =
            HashMap::with_capacity_and_hasher(distinct.len(), IdBuildHasher::default());
        let mut pairs = Vec::with_capacity(distinct.len());
        for &device in &distinct {
            let host = self
                .cpu
                .pop_free()
                .ok_or_else(|| broken_free_count("host"))?;
            mapping.insert(device, host);
            pairs.push((device, host));
        }
        for &seq in seqs {
            let Some(table) = self.tables.get_mut(&seq) else {
                continue;
            };
            for block in table.blocks.iter_mut().rev() {
                let host = mapping[block];
                self.cpu.incref(host);
                release_device_block(&mut self.gpu, &self.prefix_cache, *block);
                *block = host;
            }
            table.location = Location::Host;
        }
        // pop_free's initial reference was only a placeholder for the table references.
        for &(_, host) in &pairs {
            self.cpu.decref(host, false);
        }
        Ok(pairs)
    }

    /// OK / LATER / NEVER for swapping the group back in, plus `num_lookahead_slots` per
    /// sequence (errors for unknown, repeated or not swapped-out sequences).
    pub fn check_swap_in(&self, seqs: &[SeqId], num_lookahead_slots: usize) -> Result<AllocStatus> {
        let distinct = self.group_blocks(seqs, Location::Host)?.len();
        let lookahead = seqs.len() * blocks_for(num_lookahead_slots, self.config.block_size);
        let needed = distinct + lookahead;
        Ok(if needed > self.gpu.num_blocks() {
            AllocStatus::Never
        } else if self.gpu.num_free() < needed + self.watermark_blocks {
            AllocStatus::Later
        } else {
            AllocStatus::Ok
        })
    }

    /// `check_swap_in`, with any error answered `Never`.
    pub fn can_swap_in(&self, seqs: &[SeqId], num_lookahead_slots: usize) -> AllocStatus {
        self.check_swap_in(seqs, num_lookahead_slots)
            .unwrap_or(AllocStatus::Never)
    }

    /// OK / LATER / NEVER for swapping the group back in *and* then taking `extra_blocks`
    /// more (the appends and CoW copies of the tokens it computes in the same step): a group
    /// swapped in without room for its next tokens would only be swapped out again.
    /// `keep_watermark` is false when nothing else runs: the watermark protects running
    /// requests, and with none it would only keep the group out for good.
    pub fn can_swap_in_and_grow(
        &self,
        seqs: &[SeqId],
        extra_blocks: usize,
        keep_watermark: bool,
    ) -> AllocStatus {
        let Ok(distinct) = self.group_blocks(seqs, Location::Host) else {
            return AllocStatus::Never;
        };
        let needed = distinct.len() + extra_blocks;
        let reserve = if keep_watermark {
            self.watermark_blocks
        } else {
            0
        };
        if needed > self.gpu.num_blocks() {
            AllocStatus::Never
        } else if self.gpu.num_free() < needed + reserve {
            AllocStatus::Later
        } else {
            AllocStatus::Ok
        }
    }

    /// Moves the group's host blocks back to device blocks (sharing kept) and frees the host
    /// blocks. Returns the (host, device) copy pairs.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let distinct = self.group_blocks(seqs, Location::Host)?;
        if distinct.len() > self.gpu.num_free() {
            return Err(Error::OutOfDeviceBlocks {
                needed: distinct.len(),
                free: self.gpu.num_free(),
            });
        }
        let mut mapping: HashMap<BlockId, BlockId, IdBuildHasher> =
            HashMap::with_capacity_and_hasher(distinct.len(), IdBuildHasher::default());
        let mut pairs = Vec::with_capacity(distinct.len());
        for &host in &distinct {
            let device = take_device_block(&mut self.gpu, &mut self.prefix_cache)
                .ok_or_else(|| broken_free_count("device"))?;
            mapping.insert(host, device);
            pairs.push((host, device));
        }
        for &seq in seqs {
            let Some(table) = self.tables.get_mut(&seq) else {
                continue;
            };
            for block in table.blocks.iter_mut() {
                let device = mapping[block];
                self.gpu.incref(device);
                self.cpu.decref(*block, false);
                *block = device;
            }
            table.location = Location::Device;
            // Fresh device blocks are unregistered: offer them to the cache again.
            table.num_registered = 0;
        }
        for &(_, device) in &pairs {
            self.gpu.decref(device, false);
        }
        Ok(pairs)
    }

    // ---- invariants -------------------------------------------------------------------------

    /// SPEC §3 invariants: per pool free + in use = total and a consistent free stack / LRU
    /// list; every ref count equals the number of table references (so nothing leaks and no
    /// block is both free and referenced); prefix-cache map and block hashes agree; cached
    /// blocks are registered; tables are well-formed.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.gpu.check("device")?;
        self.cpu.check("host")?;
        self.prefix_cache.check()?;
        let mut gpu_refs = vec![0u32; self.gpu.num_blocks()];
        let mut cpu_refs = vec![0u32; self.cpu.num_blocks()];
        for (&seq, table) in &self.tables {
            let (refs, name) = match table.location {
                Location::Device => (&mut gpu_refs, "device"),
                Location::Host => (&mut cpu_refs, "host"),
            };
            for &block in &table.blocks {
                let count = refs.get_mut(block as usize).ok_or_else(|| {
                    format!("sequence {seq} references {name} block {block} outside the pool")
                })?;
                *count += 1;
            }
            if table.num_registered > table.len() || table.num_registered > table.hashes.len() {
                return Err(format!(
                    "sequence {seq}: {} registered blocks but {} blocks and {} hashes",
                    table.num_registered,
                    table.len(),
                    table.hashes.len()
                ));
            }
        }
        for (pool, refs, name) in [
            (&self.gpu, &gpu_refs, "device"),
            (&self.cpu, &cpu_refs, "host"),
        ] {
            for (block, &expected) in refs.iter().enumerate() {
                let actual = pool.ref_count(block as BlockId).unwrap_or(0);
                if actual != expected {
                    return Err(format!(
                        "{name} block {block}: ref count {actual} but {expected} table references"
                    ));
                }
            }
        }
        for block in 0..self.gpu.num_blocks() as BlockId {
            let registered = self.prefix_cache.is_registered(block);
            match self.gpu.state(block) {
                Some(BlockState::Cached) if !registered => {
                    return Err(format!(
                        "device block {block} is evictable but not registered"
                    ));
                }
                Some(BlockState::Free) if registered => {
                    return Err(format!("device block {block} is free but still registered"));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(block_size: usize, gpu: usize, cpu: usize) -> KvCacheManager {
        let mut cfg = CacheConfig::new(block_size, gpu, cpu);
        cfg.watermark = 0.0;
        KvCacheManager::new(cfg).unwrap()
    }

    fn alloc(m: &mut KvCacheManager, seq: SeqId, tokens: &[TokenId]) -> Option<usize> {
        let r = m.allocate_prompt(seq, tokens, None, 0, false).unwrap();
        m.check_invariants().unwrap();
        r
    }

    fn toks(range: std::ops::Range<u32>) -> Vec<TokenId> {
        range.collect()
    }

    #[test]
    fn new_rejects_block_size_zero_and_bad_watermark() {
        assert!(matches!(
            KvCacheManager::new(CacheConfig::new(0, 4, 0)),
            Err(Error::InvalidArgument(_))
        ));
        for w in [-0.1, 1.0, f64::NAN] {
            let mut cfg = CacheConfig::new(4, 4, 0);
            cfg.watermark = w;
            assert!(matches!(
                KvCacheManager::new(cfg),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn allocate_builds_a_table_of_ceil_slots_blocks() {
        let mut m = manager(4, 8, 0);
        assert_eq!(alloc(&mut m, 1, &toks(0..10)), Some(0));
        assert_eq!(m.block_table(1).unwrap(), &[0, 1, 2]);
        assert_eq!(m.num_free_gpu_blocks(), 5);
        assert!((m.usage() - 3.0 / 8.0).abs() < 1e-12);
        assert_eq!(m.table(1).unwrap().slot(9, 4), Some(9));
    }

    #[test]
    fn allocate_without_room_changes_nothing() {
        let mut m = manager(4, 2, 0);
        assert_eq!(alloc(&mut m, 1, &toks(0..12)), None);
        assert!(!m.contains(1));
        assert_eq!(m.num_free_gpu_blocks(), 2);
    }

    #[test]
    fn batched_registration_matches_one_by_one() {
        // seq 1: one new block (staged); seq 2: two new blocks (general path); seq 3: same
        // tokens as seq 1 (its hash is taken by then, in both orders of work); seq 4: nothing
        // new; allocate_owned moves the hit's chain in.
        let t1 = toks(0..9);
        let t2 = toks(100..110);
        let run = |batched: bool| {
            let mut m = manager(4, 32, 0);
            for (seq, t) in [(1, &t1), (2, &t2), (3, &t1), (4, &t2)] {
                let hit = m.find_prefix(&t[..1], 0);
                assert!(m.allocate_owned(seq, hit, t.len(), false).unwrap());
            }
            m.cache_full_blocks(4, &t2, 8, 0).unwrap();
            let items: [(SeqId, &[TokenId], usize, u64); 4] = [
                (1, &t1, 4, 0),
                (2, &t2, 9, 0),
                (3, &t1, 5, 0),
                (4, &t2, 8, 0),
            ];
            let n = if batched {
                m.cache_full_blocks_batch(&items).unwrap()
            } else {
                items
                    .iter()
                    .map(|&(s, t, c, k)| m.cache_full_blocks(s, t, c, k).unwrap())
                    .sum()
            };
            m.check_invariants().unwrap();
            let hashes: Vec<_> = (0..32).map(|b| m.block_hash(b)).collect();
            (n, hashes, m.stats().num_registered_blocks)
        };
        assert_eq!(run(true), run(false));
        assert_eq!(run(true).0, 1);
    }

    #[test]
    fn allocate_duplicate_sequence_is_an_error() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..4));
        let before = m.prefix_cache_stats();
        assert_eq!(
            m.allocate_prompt(1, &toks(0..4), None, 0, false),
            Err(Error::DuplicateSequence(1))
        );
        assert_eq!(m.prefix_cache_stats(), before);
        assert_eq!(m.block_table(1).unwrap(), &[0]);
    }

    #[test]
    fn allocate_respects_the_watermark_when_asked() {
        let mut cfg = CacheConfig::new(1, 10, 0);
        cfg.watermark = 0.2;
        let mut m = KvCacheManager::new(cfg).unwrap();
        assert_eq!(m.watermark_blocks(), 2);
        assert_eq!(
            m.allocate_prompt(1, &toks(0..9), None, 0, true).unwrap(),
            None
        );
        assert_eq!(
            m.allocate_prompt(1, &toks(0..9), None, 0, false).unwrap(),
            Some(0)
        );
        m.check_invariants().unwrap();
    }

    #[test]
    fn can_allocate_answers_ok_later_never() {
        let mut cfg = CacheConfig::new(4, 10, 0);
        cfg.watermark = 0.1; // 1 block
        let mut m = KvCacheManager::new(cfg).unwrap();
        assert_eq!(m.can_allocate(36), AllocStatus::Ok); // 9 blocks + 1 watermark = 10
        assert_eq!(m.can_allocate(37), AllocStatus::Never); // 10 > 10 - 1
        m.allocate_prompt(1, &toks(0..8), None, 0, true)
            .unwrap()
            .unwrap();
        assert_eq!(m.can_allocate(28), AllocStatus::Ok); // 8 free - 7 = 1
        assert_eq!(m.can_allocate(29), AllocStatus::Later); // 8 free - 8 = 0 < 1
    }

    #[test]
    fn can_append_slots_counts_one_block_per_seq_plus_lookahead() {
        let mut m = manager(4, 4, 0);
        assert!(m.can_append_slots(4, 0));
        assert!(!m.can_append_slots(5, 0));
        assert!(m.can_append_slots(2, 4)); // 2 * (1 + 1)
        assert!(!m.can_append_slots(2, 5)); // 2 * (1 + 2)
        alloc(&mut m, 1, &toks(0..4));
        assert!(!m.can_append_slots(4, 0));
    }

    #[test]
    fn append_slots_grows_the_table() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..4));
        assert_eq!(m.append_slots(1, 4, 5).unwrap(), Some(vec![]));
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        // Still room in block 1: no new block.
        assert_eq!(m.append_slots(1, 5, 6).unwrap(), Some(vec![]));
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        assert_eq!(m.append_slots(1, 6, 16).unwrap(), Some(vec![]));
        assert_eq!(m.block_table(1).unwrap().len(), 4);
        m.check_invariants().unwrap();
    }

    #[test]
    fn append_slots_out_of_blocks_changes_nothing() {
        let mut m = manager(4, 2, 0);
        alloc(&mut m, 1, &toks(0..6));
        m.fork(1, 2).unwrap();
        // CoW of the shared last block needs a block, the growth another: only 0 free.
        assert_eq!(m.append_slots(2, 6, 9).unwrap(), None);
        assert_eq!(m.block_table(2).unwrap(), &[0, 1]);
        assert_eq!(m.gpu_ref_count(1), Some(2));
        m.check_invariants().unwrap();
    }

    #[test]
    fn fork_shares_blocks_and_append_copies_on_write() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..6));
        m.fork(1, 2).unwrap();
        assert_eq!(m.gpu_ref_count(0), Some(2));
        assert_eq!(m.gpu_ref_count(1), Some(2));
        // Writing slot 6 lands in shared block 1: copy it, keep full block 0 shared.
        let copies = m.append_slots(2, 6, 7).unwrap().unwrap();
        assert_eq!(copies, vec![(1, 2)]);
        assert_eq!(m.block_table(2).unwrap(), &[0, 2]);
        assert_eq!(m.gpu_ref_count(1), Some(1));
        assert_eq!(m.gpu_ref_count(0), Some(2));
        // The parent now owns block 1 alone: no copy.
        assert_eq!(m.append_slots(1, 6, 7).unwrap().unwrap(), vec![]);
        m.check_invariants().unwrap();
    }

    #[test]
    fn fork_errors() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..4));
        alloc(&mut m, 2, &toks(10..14));
        assert_eq!(m.fork(9, 3), Err(Error::UnknownSequence(9)));
        assert_eq!(m.fork(1, 2), Err(Error::DuplicateSequence(2)));
        assert_eq!(m.fork(1, 1), Err(Error::DuplicateSequence(1)));
        assert_eq!(m.gpu_ref_count(0), Some(1));
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_returns_blocks_and_double_free_is_an_error() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..6));
        m.fork(1, 2).unwrap();
        m.free(1).unwrap();
        assert_eq!(m.num_free_gpu_blocks(), 6);
        m.free(2).unwrap();
        assert_eq!(m.num_free_gpu_blocks(), 8);
        assert_eq!(m.free(2), Err(Error::UnknownSequence(2)));
        m.check_invariants().unwrap();
    }

    #[test]
    fn unknown_sequences_are_errors_everywhere() {
        let mut m = manager(4, 8, 4);
        assert_eq!(m.block_table(5).unwrap_err(), Error::UnknownSequence(5));
        assert_eq!(
            m.append_slots(5, 0, 1).unwrap_err(),
            Error::UnknownSequence(5)
        );
        assert_eq!(
            m.cache_full_blocks(5, &[], 0, 0).unwrap_err(),
            Error::UnknownSequence(5)
        );
        assert_eq!(m.swap_out(&[5]).unwrap_err(), Error::UnknownSequence(5));
        assert_eq!(m.swap_in(&[5]).unwrap_err(), Error::UnknownSequence(5));
        assert_eq!(
            m.check_swap_in(&[5], 0).unwrap_err(),
            Error::UnknownSequence(5)
        );
        assert!(!m.can_swap_out(&[5]));
        assert_eq!(m.can_swap_in(&[5], 0), AllocStatus::Never);
        assert!(!m.is_swapped(5));
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_hit_reuses_cached_blocks_and_computes_last_token() {
        let mut m = manager(4, 16, 0);
        let prompt = toks(0..12);
        alloc(&mut m, 1, &prompt);
        assert_eq!(m.cache_full_blocks(1, &prompt, 12, 0).unwrap(), 3);
        // Same prompt: the third block holds the last token, so only two blocks are reused.
        assert_eq!(alloc(&mut m, 2, &prompt), Some(8));
        let t1 = m.block_table(1).unwrap().to_vec();
        let t2 = m.block_table(2).unwrap().to_vec();
        assert_eq!(t2[..2], t1[..2]);
        assert_ne!(t2[2], t1[2]);
        assert_eq!(m.gpu_ref_count(t1[0]), Some(2));
        // Longer prompt with the same start: three blocks reused.
        let longer = toks(0..14);
        assert_eq!(alloc(&mut m, 3, &longer), Some(12));
        let s = m.prefix_cache_stats();
        assert_eq!((s.queries, s.hits, s.misses), (3, 5, 2));
    }

    #[test]
    fn extra_key_separates_prefixes() {
        let mut m = manager(4, 16, 0);
        let prompt = toks(0..9);
        alloc(&mut m, 1, &prompt);
        m.cache_full_blocks(1, &prompt, 9, 0).unwrap();
        assert_eq!(
            m.allocate_prompt(2, &prompt, None, 7, false).unwrap(),
            Some(0)
        );
        assert_eq!(
            m.allocate_prompt(3, &prompt, None, 0, false).unwrap(),
            Some(8)
        );
        m.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_blocks_wait_and_are_revived_by_a_hit() {
        let mut m = manager(4, 8, 0);
        let prompt = toks(0..9);
        alloc(&mut m, 1, &prompt);
        m.cache_full_blocks(1, &prompt, 9, 0).unwrap();
        let t1 = m.block_table(1).unwrap().to_vec();
        m.free(1).unwrap();
        // Two full blocks cached (deepest first in eviction order), the partial one freed.
        assert_eq!(m.evictable_blocks(), vec![t1[1], t1[0]]);
        assert_eq!(m.num_free_gpu_blocks(), 8);
        assert_eq!(alloc(&mut m, 2, &prompt), Some(8));
        assert_eq!(m.block_table(2).unwrap()[..2], t1[..2]);
        assert!(m.evictable_blocks().is_empty());
    }

    #[test]
    fn never_used_blocks_go_before_evictions_and_lru_evicts_oldest_deepest_first() {
        let mut m = manager(2, 6, 0);
        let a = toks(0..5); // blocks: [0,1] [2,3] partial [4]
        let b = toks(100..105);
        alloc(&mut m, 1, &a);
        m.cache_full_blocks(1, &a, 5, 0).unwrap();
        alloc(&mut m, 2, &b);
        m.cache_full_blocks(2, &b, 5, 0).unwrap();
        let ta = m.block_table(1).unwrap().to_vec();
        let tb = m.block_table(2).unwrap().to_vec();
        m.free(1).unwrap();
        m.free(2).unwrap();
        assert_eq!(m.evictable_blocks(), vec![ta[1], ta[0], tb[1], tb[0]]);
        // Two uncached free blocks (the partial ones) go first, then a's deepest, then a's root.
        alloc(&mut m, 3, &toks(200..206));
        let t3 = m.block_table(3).unwrap().to_vec();
        assert_eq!(t3.len(), 3);
        assert!(t3.contains(&ta[2]) && t3.contains(&tb[2]) && t3.contains(&ta[1]));
        assert_eq!(m.prefix_cache_stats().evictions, 1);
        assert_eq!(m.block_hash(ta[1]), None);
        assert_eq!(m.evictable_blocks(), vec![ta[0], tb[1], tb[0]]);
    }

    #[test]
    fn hit_blocks_are_not_evicted_by_the_same_allocation() {
        let mut m = manager(2, 3, 0);
        let p = toks(0..3);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 3, 0).unwrap();
        m.free(1).unwrap();
        // Block 0 cached; allocating p again revives it and needs one more block.
        assert_eq!(alloc(&mut m, 2, &p), Some(2));
        assert_eq!(m.block_table(2).unwrap()[0], 0);
    }

    #[test]
    fn stale_prefix_hit_is_rejected_without_change() {
        let mut m = manager(2, 2, 0);
        let p = toks(0..3);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 3, 0).unwrap();
        m.free(1).unwrap();
        let hit = m.lookup_prefix(&p, 0);
        assert_eq!(hit.blocks.len(), 1);
        // Another allocation evicts the hit block.
        alloc(&mut m, 2, &toks(50..54));
        let free = m.num_free_gpu_blocks();
        assert!(matches!(
            m.allocate(3, &hit, 3, false),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(m.num_free_gpu_blocks(), free);
        m.check_invariants().unwrap();
    }

    #[test]
    fn find_prefix_is_read_only() {
        let mut m = manager(2, 4, 0);
        let p = toks(0..5);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 5, 0).unwrap();
        let before = m.prefix_cache_stats();
        let hit = m.find_prefix(&p, 0);
        assert_eq!(hit.num_cached_tokens, 4);
        assert_eq!(hit.hashes.len(), 2);
        assert_eq!(m.prefix_cache_stats(), before);
    }

    #[test]
    fn cache_full_blocks_keeps_an_existing_mapping() {
        let mut m = manager(2, 8, 0);
        let p = toks(0..4);
        // Both allocated before either is registered: the second registration is skipped.
        alloc(&mut m, 1, &p);
        alloc(&mut m, 2, &p);
        assert_eq!(m.cache_full_blocks(1, &p, 4, 0).unwrap(), 2);
        assert_eq!(m.cache_full_blocks(2, &p, 4, 0).unwrap(), 0);
        let t2 = m.block_table(2).unwrap().to_vec();
        assert_eq!(m.block_hash(t2[0]), None);
        m.free(2).unwrap();
        assert_eq!(m.num_cached_gpu_blocks(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn cache_full_blocks_registers_incrementally_during_decode() {
        let mut m = manager(2, 8, 0);
        let mut tokens = toks(0..3);
        alloc(&mut m, 1, &tokens);
        assert_eq!(m.cache_full_blocks(1, &tokens, 3, 0).unwrap(), 1);
        tokens.push(3);
        m.append_slots(1, 3, 4).unwrap().unwrap();
        assert_eq!(m.cache_full_blocks(1, &tokens, 4, 0).unwrap(), 1);
        assert_eq!(m.cache_full_blocks(1, &tokens, 4, 0).unwrap(), 0);
        // A later request with the decoded tokens in its prompt reuses both blocks.
        assert_eq!(alloc(&mut m, 2, &toks(0..5)), Some(4));
    }

    #[test]
    fn cache_full_blocks_rejects_counts_past_the_tokens_or_table() {
        let mut m = manager(2, 8, 0);
        alloc(&mut m, 1, &toks(0..3));
        assert!(matches!(
            m.cache_full_blocks(1, &toks(0..3), 4, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            m.cache_full_blocks(1, &toks(0..6), 6, 0),
            Err(Error::InvalidArgument(_))
        ));
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_caching_off_registers_nothing() {
        let mut cfg = CacheConfig::new(2, 8, 0);
        cfg.enable_prefix_caching = false;
        let mut m = KvCacheManager::new(cfg).unwrap();
        let p = toks(0..5);
        m.allocate_prompt(1, &p, None, 0, false).unwrap();
        assert_eq!(m.cache_full_blocks(1, &p, 5, 0).unwrap(), 0);
        assert_eq!(m.allocate_prompt(2, &p, None, 0, false).unwrap(), Some(0));
        m.free(1).unwrap();
        assert_eq!(m.num_cached_gpu_blocks(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn reset_prefix_cache_frees_cached_blocks() {
        let mut m = manager(2, 8, 0);
        let p = toks(0..5);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 5, 0).unwrap();
        alloc(&mut m, 2, &toks(10..15));
        m.cache_full_blocks(2, &toks(10..15), 5, 0).unwrap();
        m.free(1).unwrap();
        m.reset_prefix_cache();
        m.check_invariants().unwrap();
        assert_eq!(m.num_cached_gpu_blocks(), 0);
        assert_eq!(m.stats().num_registered_blocks, 0);
        assert_eq!(alloc(&mut m, 3, &p), Some(0));
    }

    #[test]
    fn swap_out_and_in_keep_sharing() {
        let mut m = manager(4, 8, 8);
        alloc(&mut m, 1, &toks(0..6));
        m.fork(1, 2).unwrap();
        m.append_slots(2, 6, 7).unwrap().unwrap(); // seq 2: [0, 2], seq 1: [0, 1]
        assert!(m.can_swap_out(&[1, 2]));
        let out = m.swap_out(&[1, 2]).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(out.len(), 3, "shared block 0 crosses once");
        assert!(m.is_swapped(1) && m.is_swapped(2));
        assert_eq!(m.num_free_gpu_blocks(), 8);
        assert_eq!(m.num_free_cpu_blocks(), 5);
        let h1 = m.block_table(1).unwrap().to_vec();
        let h2 = m.block_table(2).unwrap().to_vec();
        assert_eq!(h1[0], h2[0]);
        assert_eq!(m.cpu_ref_count(h1[0]), Some(2));
        assert_eq!(m.can_swap_in(&[1, 2], 0), AllocStatus::Ok);
        let back = m.swap_in(&[1, 2]).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(m.num_free_cpu_blocks(), 8);
        let d1 = m.block_table(1).unwrap().to_vec();
        let d2 = m.block_table(2).unwrap().to_vec();
        assert_eq!(d1[0], d2[0]);
        assert_eq!(m.gpu_ref_count(d1[0]), Some(2));
        // The pairs map each table entry back to where it went.
        for (h, d) in back {
            assert!(
                h1.iter().zip(&d1).any(|(&x, &y)| x == h && y == d)
                    || h2.iter().zip(&d2).any(|(&x, &y)| x == h && y == d)
            );
        }
    }

    #[test]
    fn swap_out_without_host_room_changes_nothing() {
        let mut m = manager(4, 8, 1);
        alloc(&mut m, 1, &toks(0..8));
        assert!(!m.can_swap_out(&[1]));
        assert_eq!(
            m.swap_out(&[1]),
            Err(Error::OutOfHostBlocks { needed: 2, free: 1 })
        );
        assert!(!m.is_swapped(1));
        assert_eq!(m.block_table(1).unwrap(), &[0, 1]);
        m.check_invariants().unwrap();
    }

    #[test]
    fn swap_in_without_device_room_changes_nothing() {
        let mut m = manager(4, 2, 4);
        alloc(&mut m, 1, &toks(0..8));
        m.swap_out(&[1]).unwrap();
        alloc(&mut m, 2, &toks(0..5));
        assert_eq!(m.can_swap_in(&[1], 0), AllocStatus::Later);
        assert_eq!(
            m.swap_in(&[1]),
            Err(Error::OutOfDeviceBlocks { needed: 2, free: 0 })
        );
        assert!(m.is_swapped(1));
        m.check_invariants().unwrap();
    }

    #[test]
    fn can_swap_in_never_when_group_exceeds_device_pool() {
        let mut m = manager(4, 2, 4);
        alloc(&mut m, 1, &toks(0..8));
        m.swap_out(&[1]).unwrap();
        assert_eq!(m.can_swap_in(&[1], 0), AllocStatus::Ok);
        assert_eq!(m.can_swap_in(&[1], 1), AllocStatus::Never);
    }

    #[test]
    fn swap_in_and_grow_counts_the_next_blocks_and_the_watermark_only_when_asked() {
        // 10 device blocks, watermark 2 (20 %); a group of 6 blocks needing 2 more to grow
        let mut m = KvCacheManager::new(CacheConfig {
            block_size: 4,
            num_gpu_blocks: 10,
            num_cpu_blocks: 10,
            watermark: 0.2,
            enable_prefix_caching: false,
        })
        .unwrap();
        alloc(&mut m, 1, &toks(0..24));
        m.swap_out(&[1]).unwrap();
        assert_eq!(m.can_swap_in_and_grow(&[1], 2, false), AllocStatus::Ok);
        assert_eq!(m.can_swap_in_and_grow(&[1], 3, true), AllocStatus::Later);
        assert_eq!(m.can_swap_in_and_grow(&[1], 4, false), AllocStatus::Ok);
        assert_eq!(m.can_swap_in_and_grow(&[1], 5, false), AllocStatus::Never);
        assert_eq!(m.can_swap_in_and_grow(&[2], 0, false), AllocStatus::Never);
    }

    #[test]
    fn swap_rejects_wrong_location_and_repeated_ids() {
        let mut m = manager(4, 4, 4);
        alloc(&mut m, 1, &toks(0..4));
        assert!(matches!(m.swap_in(&[1]), Err(Error::InvalidState(_))));
        assert!(matches!(
            m.swap_out(&[1, 1]),
            Err(Error::InvalidArgument(_))
        ));
        m.swap_out(&[1]).unwrap();
        assert!(matches!(m.swap_out(&[1]), Err(Error::InvalidState(_))));
        assert!(matches!(
            m.append_slots(1, 4, 5),
            Err(Error::InvalidState(_))
        ));
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_of_a_swapped_sequence_releases_host_blocks() {
        let mut m = manager(4, 4, 4);
        alloc(&mut m, 1, &toks(0..8));
        m.fork(1, 2).unwrap();
        m.swap_out(&[1, 2]).unwrap();
        m.free(1).unwrap();
        assert_eq!(m.num_free_cpu_blocks(), 2);
        m.free(2).unwrap();
        assert_eq!(m.num_free_cpu_blocks(), 4);
        m.check_invariants().unwrap();
    }

    #[test]
    fn swap_out_keeps_blocks_shared_with_sequences_outside_the_group() {
        let mut m = manager(2, 8, 8);
        let p = toks(0..5);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 5, 0).unwrap();
        assert_eq!(alloc(&mut m, 2, &p), Some(4));
        m.swap_out(&[2]).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(m.gpu_ref_count(0), Some(1));
        m.swap_in(&[2]).unwrap();
        // Swapped-in copies are re-offered to the cache; the originals keep their mapping.
        assert_eq!(m.cache_full_blocks(2, &p, 5, 0).unwrap(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn stats_report_counts_and_usage() {
        let mut m = manager(4, 8, 4);
        alloc(&mut m, 1, &toks(0..8));
        alloc(&mut m, 2, &toks(0..8));
        m.swap_out(&[2]).unwrap();
        let s = m.stats();
        assert_eq!(s.num_free_gpu_blocks, 6);
        assert_eq!(s.num_free_cpu_blocks, 2);
        assert_eq!(s.num_sequences, 2);
        assert_eq!(s.num_swapped_sequences, 1);
        assert!((s.gpu_usage - 0.25).abs() < 1e-12);
        assert!((s.cpu_usage - 0.5).abs() < 1e-12);
        assert_eq!(s.prefix_cache.queries, 2);
    }

    #[test]
    fn all_blocks_free_after_every_sequence_finishes() {
        let mut m = manager(2, 16, 8);
        let p = toks(0..7);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 7, 0).unwrap();
        m.fork(1, 2).unwrap();
        alloc(&mut m, 3, &p);
        m.append_slots(2, 7, 9).unwrap().unwrap();
        m.swap_out(&[3]).unwrap();
        for s in [1, 2, 3] {
            m.free(s).unwrap();
        }
        m.check_invariants().unwrap();
        assert_eq!(m.num_free_gpu_blocks(), 16);
        assert_eq!(m.num_free_cpu_blocks(), 8);
    }
}
