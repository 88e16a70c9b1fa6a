//! The prefix cache seen from the manager: lookups, registration of full blocks (one
//! sequence, or a step's decode fills in one batch), the per-step journal a failed step is
//! rolled back with, and reset.
use super::block_pool::BlockState;
use super::block_table::{BlockTable, Location};
use super::manager::{device_table_mut, KvCacheManager};
use super::prefix_cache::{extend_chain, hash_block, PrefixHit, ROOT_HASH};
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId, TokenId};

/// Full blocks of `tokens[..num_computed]`; `None` when `num_computed` is past the tokens
/// given or the sequence's table (see `bad_num_computed`).
#[inline]
fn full_blocks(
    table: &BlockTable,
    tokens: &[TokenId],
    num_computed: usize,
    bs: usize,
) -> Option<usize> {
    let full = num_computed / bs;
    (num_computed <= tokens.len() && full <= table.len()).then_some(full)
}

/// The error for a `num_computed` that `full_blocks` refused.
#[cold]
fn bad_num_computed(
    table: &BlockTable,
    seq: SeqId,
    tokens: &[TokenId],
    num_computed: usize,
    bs: usize,
) -> Error {
    Error::InvalidArgument(if num_computed > tokens.len() {
        format!(
            "num_computed_tokens {num_computed} exceeds the {} tokens given",
            tokens.len()
        )
    } else {
        format!(
            "num_computed_tokens {num_computed} exceeds the {} slots of sequence {seq}",
            table.capacity(bs)
        )
    })
}

/// Decode's common case: exactly one block has newly filled (`full` is one past the blocks
/// offered so far) and the hash chain reaches its parent. Hashes it straight from its parent
/// (no chain loop), marks it offered and returns (block, hash) to register. `None`, with
/// nothing changed, for anything else. The parent hash comes back too (for the KV events).
#[inline]
fn stage_next_block(
    table: &mut BlockTable,
    tokens: &[TokenId],
    full: usize,
    bs: usize,
    extra_key: u64,
) -> Option<(BlockId, u64, u64)> {
    if full != table.num_registered + 1 || table.hashes.len() + 1 != full {
        return None;
    }
    let i = full - 1;
    let parent = table.hashes.last().copied().unwrap_or(ROOT_HASH);
    let hash = hash_block(parent, &tokens[i * bs..full * bs], extra_key);
    table.hashes.push(hash);
    table.num_registered = full;
    Some((table.blocks[i], hash, parent))
}

impl KvCacheManager {
    /// Read-only prefix query: no counters move.
    pub fn find_prefix(&self, tokens: &[TokenId], extra_key: u64) -> PrefixHit {
        if self.hybrid {
            return self.find_hybrid(tokens, extra_key);
        }
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
        let table = device_table_mut(&mut self.tables, seq)?;
        let Some(full) = full_blocks(table, tokens, num_computed, bs) else {
            return Err(bad_num_computed(table, seq, tokens, num_computed, bs));
        };
        if !self.prefix_cache.is_enabled() || full <= table.num_registered {
            return Ok(0);
        }
        if self.hybrid {
            let cache = &mut self.prefix_cache;
            return Ok(Self::register_hybrid(
                cache, table, tokens, full, bs, extra_key,
            ));
        }
        if let Some((block, hash, parent)) = stage_next_block(table, tokens, full, bs, extra_key) {
            let block_tokens = &tokens[(full - 1) * bs..full * bs];
            return Ok(self.prefix_cache.register_chained(
                block,
                hash,
                parent,
                block_tokens,
                extra_key,
            ) as usize);
        }
        extend_chain(&mut table.hashes, tokens, bs, extra_key, full);
        let mut registered = 0;
        for i in table.num_registered..full {
            let parent = if i == 0 {
                ROOT_HASH
            } else {
                table.hashes[i - 1]
            };
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            if self.prefix_cache.register_chained(
                table.blocks[i],
                table.hashes[i],
                parent,
                block_tokens,
                extra_key,
            ) {
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
        // A hybrid table registers several blocks per position: the general path.
        let enabled = self.prefix_cache.is_enabled() && !self.hybrid;
        // (block, hash) staged by the first pass; `None`: take the general path.
        let mut staged: Vec<Option<(BlockId, u64, u64)>> = Vec::with_capacity(items.len());
        for &(seq, tokens, num_computed, extra_key) in items {
            let simple = match self.tables.get_mut(&seq) {
                Some(table) if enabled && table.location == Location::Device => {
                    full_blocks(table, tokens, num_computed, bs)
                        .and_then(|full| stage_next_block(table, tokens, full, bs, extra_key))
                }
                _ => None,
            };
            if let Some((block, _, _)) = simple {
                self.prefix_cache.prefetch_block(block);
            }
            staged.push(simple);
        }
        let mut registered = 0;
        for (&(seq, tokens, num_computed, extra_key), st) in items.iter().zip(staged) {
            registered += match st {
                Some((block, hash, parent)) => {
                    let full = num_computed / bs;
                    let block_tokens = &tokens[(full - 1) * bs..full * bs];
                    self.prefix_cache
                        .register_chained(block, hash, parent, block_tokens, extra_key)
                        as usize
                }
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

    /// Whether `block` was registered since `begin_step` (its KV is computed by the step
    /// being built, which may yet be discarded).
    pub fn registered_this_step(&self, block: BlockId) -> bool {
        self.prefix_cache.in_journal(block)
    }

    /// Takes back the prefix-cache registrations made since `begin_step`, for a step whose
    /// computation failed: those blocks never received their KV. Call it once the step's
    /// sequences have released them; a block still held keeps its registration (an error,
    /// as nothing but the failed step's own sequences can hold it). Returns how many
    /// registrations were dropped.
    pub fn forget_step_registrations(&mut self) -> Result<usize> {
        let mut dropped = 0;
        for block in self.prefix_cache.take_journal() {
            match self.device.state(block) {
                Some(BlockState::Cached) => {
                    self.prefix_cache.unregister(block);
                    self.device.uncache(block);
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
        for block in self.device.lru_order() {
            self.device.uncache(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::super::{CacheConfig, KvCacheManager};
    use super::*;

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
        assert_eq!(m.num_cached_device_blocks(), 0);
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
        assert_eq!(m.num_cached_device_blocks(), 0);
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
        assert_eq!(m.num_cached_device_blocks(), 0);
        assert_eq!(m.stats().num_registered_blocks, 0);
        assert_eq!(alloc(&mut m, 3, &p), Some(0));
    }
}
