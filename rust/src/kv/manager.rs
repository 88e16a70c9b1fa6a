//! The manager's state, configuration and read-only accessors, and the block moves every
//! operation shares. The operations themselves live in the sibling modules by kind.
use std::collections::HashMap;

use super::block_pool::{BlockPool, BlockState};
use super::block_table::{BlockTable, Location};
use super::events::KvEventLog;
use super::prefix_cache::{IdBuildHasher, PrefixCache, PrefixCacheStats};
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};

#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Token slots per block.
    pub block_size: usize,
    pub num_device_blocks: usize,
    /// Host (swap space) blocks.
    pub num_host_blocks: usize,
    /// Fraction of the device pool kept free at admission, in [0, 1).
    pub watermark: f64,
    pub enable_prefix_caching: bool,
}

/// Defaults of the cache's knobs: the one place they are written (the scheduler's `defaults`,
/// the bindings and, through `_core.DEFAULTS`, Python read them from here).
pub mod defaults {
    pub const BLOCK_SIZE: usize = 16;
    pub const WATERMARK: f64 = 0.01;
    pub const ENABLE_PREFIX_CACHING: bool = true;
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            block_size: defaults::BLOCK_SIZE,
            num_device_blocks: 0,
            num_host_blocks: 0,
            watermark: defaults::WATERMARK,
            enable_prefix_caching: defaults::ENABLE_PREFIX_CACHING,
        }
    }
}

impl CacheConfig {
    /// Defaults (watermark, prefix caching) with the given sizes.
    pub fn new(block_size: usize, num_device_blocks: usize, num_host_blocks: usize) -> Self {
        Self {
            block_size,
            num_device_blocks,
            num_host_blocks,
            ..Self::default()
        }
    }

    /// The knobs' rules (`KvCacheManager::new` checks them; so can a caller before sizing).
    pub fn validate(&self) -> Result<()> {
        if self.block_size == 0 {
            return Err(Error::InvalidArgument(
                "block_size must be > 0, got 0".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(Error::InvalidArgument(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        Ok(())
    }

    /// Device blocks admission keeps free for running sequences (never given to a new one).
    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * self.num_device_blocks as f64) as usize
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct CacheStats {
    pub block_size: usize,
    pub num_device_blocks: usize,
    pub num_host_blocks: usize,
    /// Free device blocks, cached-evictable ones included.
    pub num_free_device_blocks: usize,
    pub num_free_host_blocks: usize,
    /// Device blocks with ref count 0 still holding cached contents.
    pub num_cached_device_blocks: usize,
    /// Device blocks registered in the prefix cache (in use or evictable).
    pub num_registered_blocks: usize,
    pub num_sequences: usize,
    pub num_swapped_sequences: usize,
    /// Fraction of device blocks in use.
    pub device_usage: f64,
    /// Fraction of host blocks in use.
    pub host_usage: f64,
    pub watermark_blocks: usize,
    pub prefix_cache: PrefixCacheStats,
}

/// Every sequence's block table, by sequence id.
pub(super) type Tables = HashMap<SeqId, BlockTable, IdBuildHasher>;

/// The paged KV-cache memory manager. Its state is private to the `kv` module: callers
/// (the scheduler, the bindings) go through its methods.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pub(super) config: CacheConfig,
    pub(super) device: BlockPool,
    pub(super) host: BlockPool,
    pub(super) prefix_cache: PrefixCache,
    pub(super) tables: Tables,
    pub(super) watermark_blocks: usize,
    /// Each layer group's sliding window (`None`: full attention); `groups.rs`.
    pub(super) windows: Vec<Option<usize>>,
    /// `windows` is not the one full-attention group: the hybrid paths are taken.
    pub(super) hybrid: bool,
    /// Most tokens one allocation or append adds to a sequence (a prefill chunk; unbounded
    /// when prompts are never split): bounds what a sliding-window group ever holds.
    pub(super) max_chunk: usize,
}

/// Takes a device block: an uncached free one if any, else evicts the LRU cached one.
#[inline]
pub(super) fn take_device_block(pool: &mut BlockPool, cache: &mut PrefixCache) -> Option<BlockId> {
    if let Some(block) = pool.pop_free() {
        return Some(block);
    }
    let block = pool.pop_lru()?;
    cache.evict(block);
    Some(block)
}

/// `take_device_block` after a check that guaranteed a free block.
#[inline]
pub(super) fn take_checked_device_block(
    pool: &mut BlockPool,
    cache: &mut PrefixCache,
) -> Result<BlockId> {
    take_device_block(pool, cache).ok_or_else(|| broken_free_count("device"))
}

/// Drops one reference to a device block; at zero a registered block stays cached.
#[inline]
pub(super) fn release_device_block(pool: &mut BlockPool, cache: &PrefixCache, block: BlockId) {
    pool.decref(block, cache.is_registered(block));
}

/// Error for a free count that a prior check guaranteed (only reachable through a bug).
#[cold]
pub(super) fn broken_free_count(pool: &str) -> Error {
    Error::InvalidState(format!(
        "{pool} pool ran dry after its free count was checked"
    ))
}

/// The table of a sequence that must exist and live on the device (the operations that
/// write KV or register blocks).
#[inline]
pub(super) fn device_table_mut(tables: &mut Tables, seq: SeqId) -> Result<&mut BlockTable> {
    let table = tables.get_mut(&seq).ok_or(Error::UnknownSequence(seq))?;
    if table.location == Location::Host {
        return Err(swapped_out(seq));
    }
    Ok(table)
}

#[cold]
fn swapped_out(seq: SeqId) -> Error {
    Error::InvalidState(format!("sequence {seq} is swapped out"))
}

fn usage_of(pool: &BlockPool) -> f64 {
    if pool.num_blocks() == 0 {
        0.0
    } else {
        pool.num_in_use() as f64 / pool.num_blocks() as f64
    }
}

impl KvCacheManager {
    pub fn new(config: CacheConfig) -> Result<Self> {
        config.validate()?;
        let device = BlockPool::new(config.num_device_blocks)?;
        let host = BlockPool::new(config.num_host_blocks)?;
        let prefix_cache = PrefixCache::new(config.num_device_blocks, config.enable_prefix_caching);
        let watermark_blocks = config.watermark_blocks();
        Ok(Self {
            config,
            device,
            host,
            prefix_cache,
            tables: HashMap::default(),
            watermark_blocks,
            windows: vec![None],
            hybrid: false,
            max_chunk: usize::MAX,
        })
    }

    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    pub fn watermark_blocks(&self) -> usize {
        self.watermark_blocks
    }

    pub fn num_device_blocks(&self) -> usize {
        self.device.num_blocks()
    }

    pub fn num_host_blocks(&self) -> usize {
        self.host.num_blocks()
    }

    /// Free device blocks, cached-evictable ones included.
    #[inline]
    pub fn num_free_device_blocks(&self) -> usize {
        self.device.num_free()
    }

    pub fn num_free_host_blocks(&self) -> usize {
        self.host.num_free()
    }

    /// Free device blocks holding nothing cached (taken before any cached block is evicted).
    #[inline]
    pub fn num_uncached_free_device_blocks(&self) -> usize {
        self.device.num_uncached_free()
    }

    /// Device blocks with ref count 0 whose contents are still cached.
    pub fn num_cached_device_blocks(&self) -> usize {
        self.device.num_cached()
    }

    pub fn num_sequences(&self) -> usize {
        self.tables.len()
    }

    /// Fraction of device blocks in use (cached-evictable blocks count as free).
    pub fn device_usage(&self) -> f64 {
        usage_of(&self.device)
    }

    /// Fraction of host blocks in use.
    pub fn host_usage(&self) -> f64 {
        usage_of(&self.host)
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
    pub fn device_ref_count(&self, block: BlockId) -> Option<u32> {
        self.device.ref_count(block)
    }

    /// Ref count of a host block (`None` outside the pool).
    pub fn host_ref_count(&self, block: BlockId) -> Option<u32> {
        self.host.ref_count(block)
    }

    pub fn device_block_state(&self, block: BlockId) -> Option<BlockState> {
        self.device.state(block)
    }

    /// Hash a device block is registered under in the prefix cache.
    pub fn block_hash(&self, block: BlockId) -> Option<u64> {
        self.prefix_cache.block_hash(block)
    }

    /// Cached device blocks in eviction order (first evicted first).
    pub fn evictable_blocks(&self) -> Vec<BlockId> {
        self.device.lru_order()
    }

    /// Turns KV-event recording on or off (`events.rs`).
    pub fn set_kv_events(&mut self, enabled: bool) {
        let bs = self.config.block_size;
        self.prefix_cache.events_mut().set_enabled(enabled, bs);
    }

    /// The KV-event log, drained once per step.
    pub fn kv_events_mut(&mut self) -> &mut KvEventLog {
        self.prefix_cache.events_mut()
    }

    /// Every hash registered in the prefix cache (what the KV events add up to).
    pub fn registered_hashes(&self) -> Vec<u64> {
        self.prefix_cache.registered_hashes()
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.prefix_cache.stats()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            block_size: self.config.block_size,
            num_device_blocks: self.device.num_blocks(),
            num_host_blocks: self.host.num_blocks(),
            num_free_device_blocks: self.device.num_free(),
            num_free_host_blocks: self.host.num_free(),
            num_cached_device_blocks: self.device.num_cached(),
            num_registered_blocks: self.prefix_cache.len(),
            num_sequences: self.tables.len(),
            num_swapped_sequences: self
                .tables
                .values()
                .filter(|t| t.location == Location::Host)
                .count(),
            device_usage: self.device_usage(),
            host_usage: self.host_usage(),
            watermark_blocks: self.watermark_blocks,
            prefix_cache: self.prefix_cache.stats(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::super::AllocStatus;
    use super::*;

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
    fn stats_report_counts_and_usage() {
        let mut m = manager(4, 8, 4);
        alloc(&mut m, 1, &toks(0..8));
        alloc(&mut m, 2, &toks(0..8));
        m.swap_out(&[2]).unwrap();
        let s = m.stats();
        assert_eq!(s.num_free_device_blocks, 6);
        assert_eq!(s.num_free_host_blocks, 2);
        assert_eq!(s.num_sequences, 2);
        assert_eq!(s.num_swapped_sequences, 1);
        assert!((s.device_usage - 0.25).abs() < 1e-12);
        assert!((s.host_usage - 0.5).abs() < 1e-12);
        assert_eq!(s.prefix_cache.queries, 2);
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
        assert_eq!(m.num_free_device_blocks(), 16);
        assert_eq!(m.num_free_host_blocks(), 8);
    }
}
