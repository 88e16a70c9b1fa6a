//! Allocation: a new sequence's table (from a prefix hit, by reference or by value, or
//! straight from its prompt) and a table's growth (`append_slots`, with copy-on-write of the
//! shared blocks it writes into, and the decode fast path `append_fresh_block`).
use std::borrow::Cow;

use super::block_table::{blocks_for, BlockTable};
use super::fork::{copy_shared_blocks, count_shared_blocks};
use super::groups::check_append;
use super::manager::{
    device_table_mut, take_checked_device_block, take_device_block, KvCacheManager,
};
use super::prefix_cache::PrefixHit;
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId, TokenId};

impl KvCacheManager {
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
        self.check_new_table(seq, hit)?;
        self.allocate_checked(
            seq,
            hit,
            Cow::Borrowed(&hit.hashes),
            num_slots,
            apply_watermark,
        )
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
        self.check_new_table(seq, &hit)?;
        let hashes = std::mem::take(&mut hit.hashes);
        self.allocate_checked(seq, &hit, Cow::Owned(hashes), num_slots, apply_watermark)
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
        if self.hybrid {
            // A hybrid hit cannot be cut afterwards (a shorter one needs other window
            // blocks): look up only the tokens whose blocks fit in `num_slots`.
            let hit = self.lookup_prefix(&tokens[..tokens.len().min(num_slots + 1)], extra_key);
            let cached = hit.num_cached_tokens;
            return Ok(self
                .allocate_owned(seq, hit, num_slots, apply_watermark)?
                .then_some(cached));
        }
        let mut hit = self.lookup_prefix(tokens, extra_key);
        let keep = hit.blocks.len().min(num_slots / self.config.block_size);
        hit.blocks.truncate(keep);
        hit.num_cached_tokens = keep * self.config.block_size;
        let cached = hit.num_cached_tokens;
        Ok(self
            .allocate_owned(seq, hit, num_slots, apply_watermark)?
            .then_some(cached))
    }

    /// A new table for `seq` may be built from `hit`: the id is free and the hit is well
    /// formed and still what the prefix cache holds.
    fn check_new_table(&self, seq: SeqId, hit: &PrefixHit) -> Result<()> {
        if self.tables.contains_key(&seq) {
            return Err(Error::DuplicateSequence(seq));
        }
        if self.hybrid {
            return self.check_hybrid_hit(hit);
        }
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

    /// The common path of `allocate` / `allocate_owned`, after `check_new_table`: `hashes`
    /// is the hit's chain (copied only once the allocation is sure to happen).
    fn allocate_checked(
        &mut self,
        seq: SeqId,
        hit: &PrefixHit,
        hashes: Cow<'_, [u64]>,
        num_slots: usize,
        apply_watermark: bool,
    ) -> Result<bool> {
        if self.hybrid {
            return self.allocate_hybrid(seq, hit, hashes.into_owned(), num_slots, apply_watermark);
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
        if self.device.num_free() < needed + reserve {
            return Ok(false);
        }
        // Headroom for the decode blocks to come (a full-table regrowth per doubling is a
        // copy of the whole table).
        let headroom = total + total / 2 + 2;
        let mut blocks = Vec::with_capacity(headroom);
        // Hit blocks first: once revived they are off the LRU list, so the fresh allocations
        // below cannot evict them.
        for &block in &hit.blocks {
            self.device.incref(block);
            blocks.push(block);
        }
        for _ in hit.blocks.len()..total {
            blocks.push(take_checked_device_block(
                &mut self.device,
                &mut self.prefix_cache,
            )?);
        }
        let hashes = if !self.prefix_cache.is_enabled() {
            Vec::new()
        } else {
            match hashes {
                Cow::Owned(h) => h,
                Cow::Borrowed(h) => {
                    let mut copy = Vec::with_capacity(headroom.max(h.len()));
                    copy.extend_from_slice(h);
                    copy
                }
            }
        };
        self.tables
            .insert(seq, BlockTable::new(blocks, hashes, hit.blocks.len()));
        Ok(true)
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
        if self.hybrid {
            return self.append_slots_hybrid(seq, first_new_slot, num_slots);
        }
        let bs = self.config.block_size;
        let table = device_table_mut(&mut self.tables, seq)?;
        check_append(table, seq, first_new_slot, num_slots, bs)?;
        let target = blocks_for(num_slots, bs);
        let written = (first_new_slot / bs)..target.min(table.len());
        let num_copies = count_shared_blocks(&self.device, &table.blocks[written.clone()]);
        let grow = target.saturating_sub(table.len());
        if self.device.num_free() < num_copies + grow {
            return Ok(None);
        }
        let mut copies = Vec::with_capacity(num_copies);
        copy_shared_blocks(
            &mut self.device,
            &mut self.prefix_cache,
            &mut table.blocks[written],
            &mut copies,
        )?;
        for _ in 0..grow {
            table.blocks.push(take_checked_device_block(
                &mut self.device,
                &mut self.prefix_cache,
            )?);
        }
        Ok(Some(copies))
    }

    /// Appends one fresh device block to a device-resident table and returns it: what
    /// `append_slots(seq, n, n + 1)` does when `n` is exactly the table's capacity (nothing
    /// existing is written, so nothing is copied), in one table lookup. `None` and no change
    /// when no device block is free.
    #[inline]
    pub fn append_fresh_block(&mut self, seq: SeqId) -> Result<Option<BlockId>> {
        if self.hybrid {
            // Every group grows (and the windows release what they left behind).
            let capacity = self.table(seq)?.capacity(self.config.block_size);
            return Ok(self
                .append_slots_hybrid(seq, capacity, capacity + 1)?
                .map(|_| self.tables[&seq].blocks[capacity / self.config.block_size]));
        }
        let table = device_table_mut(&mut self.tables, seq)?;
        let Some(block) = take_device_block(&mut self.device, &mut self.prefix_cache) else {
            return Ok(None);
        };
        table.blocks.push(block);
        Ok(Some(block))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::super::{CacheConfig, KvCacheManager};
    use super::*;

    #[test]
    fn allocate_builds_a_table_of_ceil_slots_blocks() {
        let mut m = manager(4, 8, 0);
        assert_eq!(alloc(&mut m, 1, &toks(0..10)), Some(0));
        assert_eq!(m.block_table(1).unwrap(), &[0, 1, 2]);
        assert_eq!(m.num_free_device_blocks(), 5);
        assert!((m.device_usage() - 3.0 / 8.0).abs() < 1e-12);
        assert_eq!(m.table(1).unwrap().slot(9, 4), Some(9));
    }

    #[test]
    fn allocate_without_room_changes_nothing() {
        let mut m = manager(4, 2, 0);
        assert_eq!(alloc(&mut m, 1, &toks(0..12)), None);
        assert!(!m.contains(1));
        assert_eq!(m.num_free_device_blocks(), 2);
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
        assert_eq!(m.device_ref_count(t1[0]), Some(2));
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
        assert_eq!(m.num_free_device_blocks(), 8);
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
        let free = m.num_free_device_blocks();
        assert!(matches!(
            m.allocate(3, &hit, 3, false),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(m.num_free_device_blocks(), free);
        m.check_invariants().unwrap();
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
    fn append_slots_past_the_table_is_an_error_not_a_panic() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..8));
        // 2 blocks = 8 slots: slot 20 would leave a gap
        assert!(matches!(
            m.append_slots(1, 20, 24),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        // appending right at the end is fine
        assert_eq!(m.append_slots(1, 8, 9).unwrap(), Some(vec![]));
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
        assert_eq!(m.device_ref_count(1), Some(2));
        m.check_invariants().unwrap();
    }
}
