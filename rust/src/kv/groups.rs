//! Hybrid KV groups (vLLM's hybrid KV-cache manager, here): a model's layers are grouped by
//! attention type, full or a sliding window of W tokens, and every group keeps its own row of
//! blocks per sequence over the one shared pool (a block holds one group's layers). A
//! sliding-window group releases the blocks that fall wholly behind its window as the
//! sequence grows (registered ones stay in the prefix cache as evictable) and a prefix hit
//! gives it only the blocks its window still reads. A manager of one full-attention group
//! (every model without windows) never enters this module's paths.
//!
//! Window rule (as `transformers`' sliding attention): a query at position `p` attends to keys
//! `p - W + 1 ..= p`.
use super::block_pool::BlockState;
use super::block_table::{blocks_for, BlockTable, NULL_BLOCK};
use super::fork::{copy_shared_blocks, count_shared_blocks};
use super::manager::{
    device_table_mut, release_device_block, take_checked_device_block, KvCacheManager,
};
use super::prefix_cache::{extend_chain, salted_key, PrefixCache, PrefixHit, ROOT_HASH};
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId, TokenId};

/// The key group `g`'s copy of a prefix block is registered under: group 0 keeps the chain
/// hash (so its KV events and a router read as before), the others salt it with their index.
#[inline]
pub(super) fn group_key(hash: u64, g: usize) -> u64 {
    if g == 0 || hash == ROOT_HASH {
        hash
    } else {
        salted_key(hash, g as u64)
    }
}

/// Leading blocks a window-`window` group no longer reads once the next query is at
/// position `pos` (every key of theirs is older than `pos - window + 1`).
#[inline]
pub fn blocks_behind_window(pos: usize, window: usize, block_size: usize) -> usize {
    (pos + 1).saturating_sub(window) / block_size
}

/// The most blocks a sequence of `num_tokens` needs at once over the groups `windows` when
/// one allocation or append adds at most `max_chunk` tokens: a full-attention group all of its
/// blocks; a window-`W` group (vLLM's rule, one chunk more) the blocks of the `W - 1` tokens
/// its window reads before the previous chunk, that chunk and the next one (an append's room
/// check counts the blocks it is about to release as still held), plus the block the span
/// straddles; never more than all of them.
pub fn max_blocks_held(
    windows: &[Option<usize>],
    max_chunk: usize,
    num_tokens: usize,
    block_size: usize,
) -> usize {
    let all = blocks_for(num_tokens, block_size);
    windows
        .iter()
        .map(|w| match w {
            None => all,
            Some(w) => {
                let span = (w - 1)
                    .saturating_add(max_chunk.saturating_mul(2))
                    .min(num_tokens);
                (blocks_for(span, block_size) + 1).min(all)
            }
        })
        .sum()
}

/// Releases the blocks of `row` before `skip` (they are a run after the `NULL_BLOCK`s already
/// released, so only the new ones are visited), deepest first.
fn release_behind(
    row: &mut [BlockId],
    skip: usize,
    device: &mut super::block_pool::BlockPool,
    cache: &PrefixCache,
) {
    let skip = skip.min(row.len());
    for entry in row[..skip].iter_mut().rev() {
        if *entry == NULL_BLOCK {
            break;
        }
        release_device_block(device, cache, *entry);
        *entry = NULL_BLOCK;
    }
}

impl KvCacheManager {
    /// Lays out the layer groups: one entry per group, its window in tokens or `None` for full
    /// attention. Only on a manager that holds no sequence. A window of 0 is an error.
    pub fn set_groups(&mut self, windows: Vec<Option<usize>>) -> Result<()> {
        if windows.is_empty() {
            return Err(Error::InvalidArgument(
                "kv groups: at least one layer group is needed".into(),
            ));
        }
        if let Some(g) = windows.iter().position(|w| *w == Some(0)) {
            return Err(Error::InvalidArgument(format!(
                "kv groups: group {g} has a sliding window of 0 tokens (use None for full \
                 attention)"
            )));
        }
        if !self.tables.is_empty() {
            return Err(Error::InvalidState(
                "kv groups can only be set before any sequence is allocated".into(),
            ));
        }
        self.hybrid = windows != [None];
        self.windows = windows;
        Ok(())
    }

    /// Bounds the tokens one allocation or append adds to a sequence (the scheduler's prefill
    /// chunk): a sliding-window group then never holds more than `max_blocks_held` says.
    pub fn set_max_chunk(&mut self, tokens: usize) {
        self.max_chunk = tokens.max(1);
    }

    /// The most blocks a sequence of `num_tokens` needs at once, every group
    /// (`max_blocks_held`, with this manager's groups and chunk).
    pub fn max_blocks_held(&self, num_tokens: usize) -> usize {
        max_blocks_held(
            &self.windows,
            self.max_chunk,
            num_tokens,
            self.config.block_size,
        )
    }

    /// Each layer group's window (`None`: full attention); `[None]` unless `set_groups` said
    /// otherwise.
    pub fn group_windows(&self) -> &[Option<usize>] {
        &self.windows
    }

    pub fn num_groups(&self) -> usize {
        self.windows.len()
    }

    /// More than one group, or a window: the paths of this module are taken.
    #[inline]
    pub fn is_hybrid(&self) -> bool {
        self.hybrid
    }

    /// Group `g`'s row of a sequence's table (`NULL_BLOCK` where a window released a block).
    pub fn group_block_table(&self, seq: SeqId, g: usize) -> Result<&[BlockId]> {
        if g >= self.windows.len() {
            return Err(Error::InvalidArgument(format!(
                "kv group {g} does not exist ({} groups)",
                self.windows.len()
            )));
        }
        Ok(self.table(seq)?.group(g))
    }

    /// Leading blocks group `g` does not hold for a sequence whose next query is at `pos`.
    #[inline]
    fn behind_window(&self, g: usize, pos: usize) -> usize {
        match self.windows[g] {
            None => 0,
            Some(w) => blocks_behind_window(pos, w, self.config.block_size),
        }
    }

    /// The hybrid prefix query (vLLM's rule): the full-attention groups need every block of
    /// the hit, a sliding-window group only the blocks its window reads from the first
    /// uncomputed token; the hit is the longest length every group agrees on.
    // Off the one-group hot paths: never inlined into them.
    #[cold]
    #[inline(never)]
    pub(super) fn find_hybrid(&self, tokens: &[TokenId], extra_key: u64) -> PrefixHit {
        let bs = self.config.block_size;
        let num_groups = self.windows.len();
        if !self.prefix_cache.is_enabled() {
            return PrefixHit {
                others: vec![Vec::new(); num_groups - 1],
                ..PrefixHit::default()
            };
        }
        let n = tokens.len() / bs;
        let mut hashes = Vec::with_capacity(n + n / 2 + 2);
        extend_chain(&mut hashes, tokens, bs, extra_key, n);
        let cached = |g: usize, i: usize| self.prefix_cache.get(group_key(hashes[i], g));
        let mut len = PrefixCache::eligible_blocks(tokens.len(), bs);
        for g in (0..num_groups).filter(|&g| self.windows[g].is_none()) {
            len = (0..len).find(|&i| cached(g, i).is_none()).unwrap_or(len);
        }
        // Each sliding group lowers the length to the longest it can serve; repeat until no
        // group lowers it (lengths only fall, and 0 suits every group).
        loop {
            let before = len;
            for g in (0..num_groups).filter(|&g| self.windows[g].is_some()) {
                let mut m = len;
                while let Some(missing) =
                    (self.behind_window(g, m * bs)..m).rfind(|&i| cached(g, i).is_none())
                {
                    m = missing;
                }
                len = m;
            }
            if len == before {
                break;
            }
        }
        let mut rows = (0..num_groups).map(|g| {
            let skip = self.behind_window(g, len * bs);
            (0..len)
                .map(|i| match i < skip {
                    true => NULL_BLOCK,
                    false => cached(g, i).unwrap_or(NULL_BLOCK),
                })
                .collect::<Vec<_>>()
        });
        let blocks = rows.next().unwrap_or_default();
        PrefixHit {
            num_cached_tokens: len * bs,
            blocks,
            others: rows.collect(),
            hashes,
        }
    }

    /// A hit for a hybrid table is well formed (a row per group, each as long as the hit,
    /// `NULL_BLOCK` exactly where the group's window does not reach) and still cached.
    // Off the one-group hot paths: never inlined into them.
    #[cold]
    #[inline(never)]
    pub(super) fn check_hybrid_hit(&self, hit: &PrefixHit) -> Result<()> {
        let bs = self.config.block_size;
        let len = hit.blocks.len();
        let malformed = |why: String| Err(Error::InvalidArgument(format!("malformed hit: {why}")));
        if hit.num_cached_tokens != len * bs || len > hit.hashes.len() {
            return malformed(format!(
                "{len} blocks, {} hashes, {} cached tokens",
                hit.hashes.len(),
                hit.num_cached_tokens
            ));
        }
        let empty_others = hit.others.is_empty() && len == 0;
        if !empty_others && hit.others.len() + 1 != self.windows.len() {
            return malformed(format!(
                "{} group rows for {} kv groups",
                hit.others.len() + 1,
                self.windows.len()
            ));
        }
        for (g, row) in std::iter::once(&hit.blocks).chain(&hit.others).enumerate() {
            if row.len() != len {
                return malformed(format!("group {g} has {} blocks, not {len}", row.len()));
            }
            let skip = self.behind_window(g, len * bs);
            for (i, &block) in row.iter().enumerate() {
                let expected = match i < skip {
                    true => None,
                    false => self.prefix_cache.get(group_key(hit.hashes[i], g)),
                };
                let actual = (block != NULL_BLOCK).then_some(block);
                if actual != expected || (i >= skip && actual.is_none()) {
                    return Err(Error::InvalidArgument(format!(
                        "stale prefix hit: group {g} block {i} is {actual:?}, the cache holds \
                         {expected:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Free blocks a hybrid `allocate(hit, num_slots)` takes: every group's fresh blocks and
    /// the cached hit blocks it revives.
    // Off the one-group hot paths: never inlined into them.
    #[cold]
    #[inline(never)]
    pub(super) fn hybrid_blocks_to_allocate(&self, hit: &PrefixHit, num_slots: usize) -> usize {
        let total = blocks_for(num_slots, self.config.block_size);
        let fresh = total.saturating_sub(hit.blocks.len()) * self.windows.len();
        let revived = std::iter::once(&hit.blocks)
            .chain(&hit.others)
            .flatten()
            .filter(|&&b| b != NULL_BLOCK && self.device.state(b) == Some(BlockState::Cached))
            .count();
        fresh + revived
    }

    /// The hybrid `allocate`, after `check_hybrid_hit`: every group's row is the hit's row
    /// (revived) plus fresh blocks up to `ceil(num_slots / block_size)`.
    // Off the one-group hot paths: never inlined into them.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_hybrid(
        &mut self,
        seq: SeqId,
        hit: &PrefixHit,
        hashes: Vec<u64>,
        num_slots: usize,
        apply_watermark: bool,
    ) -> Result<bool> {
        let total = blocks_for(num_slots, self.config.block_size);
        let len = hit.blocks.len();
        if len > total {
            return Err(Error::InvalidArgument(format!(
                "num_slots {num_slots} is fewer than the {} cached tokens of the prefix hit",
                hit.num_cached_tokens
            )));
        }
        let needed = self.hybrid_blocks_to_allocate(hit, num_slots);
        let reserve = if apply_watermark {
            self.watermark_blocks
        } else {
            0
        };
        if self.device.num_free() < needed + reserve {
            return Ok(false);
        }
        let num_groups = self.windows.len();
        let mut rows: Vec<Vec<BlockId>> = (0..num_groups)
            .map(|g| {
                let mut row = Vec::with_capacity(total + total / 2 + 2);
                match g {
                    0 => row.extend_from_slice(&hit.blocks),
                    _ => row.extend(hit.others.get(g - 1).map_or(&[][..], |r| &r[..])),
                }
                row
            })
            .collect();
        // Every hit block revived first, so no fresh allocation below evicts one.
        for &block in rows.iter().flatten().filter(|&&b| b != NULL_BLOCK) {
            self.device.incref(block);
        }
        for row in &mut rows {
            row.resize(len, NULL_BLOCK);
            for _ in len..total {
                row.push(take_checked_device_block(
                    &mut self.device,
                    &mut self.prefix_cache,
                )?);
            }
        }
        let hashes = if self.prefix_cache.is_enabled() {
            hashes
        } else {
            Vec::new()
        };
        let mut rows = rows.into_iter();
        let mut table = BlockTable::new(rows.next().unwrap_or_default(), hashes, len);
        table.others = rows.collect();
        self.tables.insert(seq, table);
        Ok(true)
    }

    /// The hybrid `append_slots`: every group's row grows to `num_slots` slots (copying the
    /// shared blocks it writes into), and each sliding-window group first releases the blocks
    /// wholly behind the window of the query at `first_new_slot`. The room check counts no
    /// released block, so `None` (no change) is answered exactly when the non-hybrid count
    /// per group would be.
    // Off the one-group hot paths: never inlined into them.
    #[cold]
    #[inline(never)]
    pub(super) fn append_slots_hybrid(
        &mut self,
        seq: SeqId,
        first_new_slot: usize,
        num_slots: usize,
    ) -> Result<Option<Vec<(BlockId, BlockId)>>> {
        let bs = self.config.block_size;
        let skips: Vec<usize> = (0..self.windows.len())
            .map(|g| self.behind_window(g, first_new_slot))
            .collect();
        let table = device_table_mut(&mut self.tables, seq)?;
        check_append(table, seq, first_new_slot, num_slots, bs)?;
        let target = blocks_for(num_slots, bs);
        let written = (first_new_slot / bs)..target.min(table.len());
        let grow = target.saturating_sub(table.len());
        let needed: usize = table
            .rows()
            .map(|row| count_shared_blocks(&self.device, &row[written.clone()]) + grow)
            .sum();
        if self.device.num_free() < needed {
            return Ok(None);
        }
        let mut copies = Vec::new();
        for (row, &skip) in table.rows_mut().zip(&skips) {
            release_behind(row, skip, &mut self.device, &self.prefix_cache);
            copy_shared_blocks(
                &mut self.device,
                &mut self.prefix_cache,
                &mut row[written.clone()],
                &mut copies,
            )?;
            for _ in 0..grow {
                row.push(take_checked_device_block(
                    &mut self.device,
                    &mut self.prefix_cache,
                )?);
            }
        }
        Ok(Some(copies))
    }

    /// Registers every held block of rows `[table.num_registered, full)` of a hybrid table
    /// under its group's key; returns how many were newly registered.
    // Off the one-group hot paths: never inlined into them.
    #[cold]
    #[inline(never)]
    pub(super) fn register_hybrid(
        cache: &mut PrefixCache,
        table: &mut BlockTable,
        tokens: &[TokenId],
        full: usize,
        bs: usize,
        extra_key: u64,
    ) -> usize {
        extend_chain(&mut table.hashes, tokens, bs, extra_key, full);
        let mut registered = 0;
        for i in table.num_registered..full {
            let hash = table.hashes[i];
            let parent = if i == 0 {
                ROOT_HASH
            } else {
                table.hashes[i - 1]
            };
            let block_tokens = &tokens[i * bs..(i + 1) * bs];
            for (g, row) in table.rows().enumerate() {
                let block = row[i];
                if block != NULL_BLOCK
                    && cache.register_chained(
                        block,
                        group_key(hash, g),
                        group_key(parent, g),
                        block_tokens,
                        extra_key,
                    )
                {
                    registered += 1;
                }
            }
        }
        table.num_registered = full;
        registered
    }

    /// Blocks a sequence holds, every group (a sliding-window group's released ones not).
    pub fn num_held_blocks(&self, seq: SeqId) -> Result<usize> {
        Ok(self.table(seq)?.num_held_blocks())
    }
}

/// `append_slots`' argument rules (shared by the plain and the hybrid path).
pub(super) fn check_append(
    table: &BlockTable,
    seq: SeqId,
    first_new_slot: usize,
    num_slots: usize,
    bs: usize,
) -> Result<()> {
    if first_new_slot > num_slots {
        return Err(Error::InvalidArgument(format!(
            "first_new_slot {first_new_slot} is past num_slots {num_slots}"
        )));
    }
    if first_new_slot > table.len() * bs {
        return Err(Error::InvalidArgument(format!(
            "first_new_slot {first_new_slot} is past the {} slots of sequence {seq}: slots \
             are appended without a gap",
            table.len() * bs
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{manager, toks};
    use super::*;

    /// A manager of `windows` groups with no watermark.
    fn hybrid(bs: usize, device: usize, host: usize, windows: &[Option<usize>]) -> KvCacheManager {
        let mut m = manager(bs, device, host);
        m.set_groups(windows.to_vec()).unwrap();
        m
    }

    /// Grows `seq` from `from` to `to` slots one block at a time, as decode and chunks do.
    fn grow(m: &mut KvCacheManager, seq: SeqId, from: usize, to: usize, step: usize) {
        let mut at = from;
        while at < to {
            let next = (at + step).min(to);
            m.append_slots(seq, at, next).unwrap().unwrap();
            m.check_invariants().unwrap();
            at = next;
        }
    }

    #[test]
    fn set_groups_rejects_bad_layouts_and_late_calls() {
        let mut m = manager(4, 8, 0);
        assert!(matches!(
            m.set_groups(vec![]),
            Err(Error::InvalidArgument(_))
        ));
        let zero = m.set_groups(vec![None, Some(0)]).unwrap_err();
        assert!(zero.to_string().contains("group 1"), "{zero}");
        m.set_groups(vec![None]).unwrap();
        assert!(!m.is_hybrid());
        m.allocate_prompt(1, &toks(0..4), None, 0, false).unwrap();
        assert!(matches!(
            m.set_groups(vec![Some(8)]),
            Err(Error::InvalidState(_))
        ));
    }

    #[test]
    fn sliding_group_releases_blocks_wholly_behind_its_window() {
        // Window 8, blocks of 4: a query at position p reads keys p-7..=p.
        let mut m = hybrid(4, 32, 0, &[None, Some(8)]);
        m.allocate_prompt(1, &toks(0..8), None, 0, false).unwrap();
        grow(&mut m, 1, 8, 24, 1);
        let t = m.table(1).unwrap();
        assert_eq!(t.group(0).len(), 6);
        // The last append started at 23: keys 16.. are read, blocks 0..4 are released.
        assert_eq!(blocks_behind_window(23, 8, 4), 4);
        assert_eq!(&t.group(1)[..4], &[NULL_BLOCK; 4]);
        assert!(t.group(1)[4..].iter().all(|&b| b != NULL_BLOCK));
        assert_eq!(m.num_held_blocks(1).unwrap(), 6 + 2);
        assert_eq!(m.num_free_device_blocks(), 32 - 8);
        m.free(1).unwrap();
        assert_eq!(m.num_free_device_blocks(), 32);
        m.check_invariants().unwrap();
    }

    #[test]
    fn released_window_blocks_stay_in_the_prefix_cache() {
        let mut m = hybrid(4, 32, 0, &[None, Some(8)]);
        let tokens = toks(0..24);
        m.allocate_prompt(1, &tokens[..8], None, 0, false).unwrap();
        m.cache_full_blocks(1, &tokens, 8, 0).unwrap();
        let first = m.table(1).unwrap().group(1)[0];
        grow(&mut m, 1, 8, 24, 4);
        assert_eq!(m.table(1).unwrap().group(1)[0], NULL_BLOCK);
        assert_eq!(m.device_block_state(first), Some(BlockState::Cached));
        assert!(m.evictable_blocks().contains(&first));
    }

    #[test]
    fn groups_register_the_same_tokens_under_different_keys() {
        let mut m = hybrid(4, 32, 0, &[None, Some(8)]);
        let tokens = toks(0..9);
        m.allocate_prompt(1, &tokens, None, 0, false).unwrap();
        assert_eq!(m.cache_full_blocks(1, &tokens, 8, 0).unwrap(), 4);
        let t = m.table(1).unwrap();
        let h0 = t.hashes[0];
        assert_eq!(m.block_hash(t.group(0)[0]), Some(h0));
        assert_eq!(m.block_hash(t.group(1)[0]), Some(group_key(h0, 1)));
        assert_ne!(group_key(h0, 1), h0);
        m.check_invariants().unwrap();
    }

    /// Seq 1 computes 40 tokens (blocks of 4, window 8) and registers them only at the end,
    /// when its window row holds just blocks 8 and 9.
    fn registered_after_the_window_moved() -> (KvCacheManager, Vec<TokenId>) {
        let mut m = hybrid(4, 64, 0, &[None, Some(8)]);
        let tokens = toks(0..40);
        m.allocate_prompt(1, &tokens[..8], None, 0, false).unwrap();
        grow(&mut m, 1, 8, 40, 4);
        m.cache_full_blocks(1, &tokens, 40, 0).unwrap();
        (m, tokens)
    }

    #[test]
    fn a_sliding_group_hit_needs_only_the_blocks_its_window_reads() {
        let (m, tokens) = registered_after_the_window_moved();
        let mut prompt = tokens.clone();
        prompt.push(7777);
        let hit = m.find_prefix(&prompt, 0);
        // The query at 40 reads keys 33..=40: blocks 8 and 9, both held and registered.
        assert_eq!(hit.num_cached_tokens, 40);
        assert_eq!(&hit.others[0][..8], &[NULL_BLOCK; 8]);
        assert_eq!(&hit.others[0][8..], &m.table(1).unwrap().group(1)[8..]);
        assert_eq!(hit.blocks, m.table(1).unwrap().group(0));
    }

    #[test]
    fn the_hit_is_the_length_every_group_agrees_on() {
        let (m, tokens) = registered_after_the_window_moved();
        // A prompt diverging after 30 tokens: the full group has 7 blocks, but the window
        // would need blocks 5 and 6 (and every shorter hit its own), never registered.
        let mut prompt = tokens[..30].to_vec();
        prompt.extend([9000, 9001]);
        assert_eq!(m.find_prefix(&prompt, 0).num_cached_tokens, 0);
    }

    #[test]
    fn allocating_from_a_hybrid_hit_shares_only_window_blocks() {
        let (mut m, tokens) = registered_after_the_window_moved();
        let mut prompt = tokens.clone();
        prompt.push(7777);
        let free = m.num_free_device_blocks();
        assert_eq!(
            m.allocate_prompt(2, &prompt, None, 0, false).unwrap(),
            Some(40)
        );
        let (t1, t2) = (m.table(1).unwrap(), m.table(2).unwrap());
        assert_eq!(t2.group(0)[..10], t1.group(0)[..10]);
        // Seq 1 still holds block 7 (its last append started at 36); the hit reads from 8.
        assert_eq!(t2.group(1)[..8], [NULL_BLOCK; 8]);
        assert_eq!(t2.group(1)[8..10], t1.group(1)[8..10]);
        // One fresh block per group for token 40; the hit blocks were in use already.
        assert_eq!(m.num_free_device_blocks(), free - 2);
        m.check_invariants().unwrap();
        // A stale hit (another group's blocks) is refused.
        let mut hit = m.find_prefix(&prompt, 0);
        hit.others[0][9] = hit.blocks[9];
        assert!(matches!(
            m.allocate(3, &hit, 41, false),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn fork_swap_and_free_move_every_groups_blocks() {
        let mut m = hybrid(4, 40, 40, &[Some(8), None, Some(12)]);
        m.allocate_prompt(1, &toks(0..8), None, 0, false).unwrap();
        grow(&mut m, 1, 8, 30, 3);
        m.fork(1, 2).unwrap();
        let held = m.num_held_blocks(1).unwrap();
        let pairs = m.swap_out(&[1, 2]).unwrap();
        assert_eq!(pairs.len(), held);
        assert_eq!(m.num_free_host_blocks(), 40 - held);
        m.check_invariants().unwrap();
        m.swap_in(&[1, 2]).unwrap();
        // The CoW of the shared tail copies it in every group.
        let copies = m.append_slots(2, 30, 31).unwrap().unwrap();
        assert_eq!(copies.len(), 3);
        assert_eq!(m.truncate_slots(2, 30).unwrap(), 0);
        m.check_invariants().unwrap();
        m.free(1).unwrap();
        m.free(2).unwrap();
        assert_eq!(m.num_free_device_blocks(), 40);
        assert_eq!(m.num_free_host_blocks(), 40);
    }

    #[test]
    fn append_fresh_block_grows_every_group() {
        let mut m = hybrid(4, 16, 0, &[None, Some(4)]);
        m.allocate_prompt(1, &toks(0..8), None, 0, false).unwrap();
        let block = m.append_fresh_block(1).unwrap().unwrap();
        let t = m.table(1).unwrap();
        assert_eq!(t.group(0)[2], block);
        assert_eq!(t.group(1).len(), 3);
        // Query at 8 reads keys 5..=8: block 0 released.
        assert_eq!(t.group(1)[0], NULL_BLOCK);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_window_group_needs_at_most_its_window_and_two_chunks() {
        let mut windows = vec![Some(32); 5];
        windows.push(None);
        // 3,104 tokens in blocks of 16: the full group all 194 blocks, each window group the
        // 31 + 2 x 512 tokens' 66 blocks plus one
        assert_eq!(max_blocks_held(&windows, 512, 3104, 16), 194 + 5 * 67);
        // an unsplit prompt: every group all of its blocks
        assert_eq!(max_blocks_held(&windows, usize::MAX, 3104, 16), 6 * 194);
        let mut m = hybrid(16, 400, 0, &windows);
        assert_eq!(m.can_allocate(3104), super::super::AllocStatus::Never);
        m.set_max_chunk(128);
        assert_eq!(m.max_blocks_held(3104), 194 + 5 * 19);
        assert_eq!(m.can_allocate(3104), super::super::AllocStatus::Ok);
    }

    #[test]
    fn gemma3_layout_holds_at_most_a_quarter_of_full_attention_at_3k_tokens() {
        // 5 local (window 32) : 1 global groups, blocks of 16, ~3k tokens: a 512-token
        // chunked prefill then 32 decode steps.
        let mut windows = vec![Some(32); 5];
        windows.push(None);
        let run = |windows: &[Option<usize>]| {
            let mut m = hybrid(16, 2048, 0, windows);
            m.allocate_prompt(1, &toks(0..512), None, 0, false).unwrap();
            grow(&mut m, 1, 512, 3072, 512);
            grow(&mut m, 1, 3072, 3104, 1);
            m.num_held_blocks(1).unwrap()
        };
        let (local, full) = (run(&windows), run(&[None; 6]));
        assert_eq!(full, 6 * 194);
        assert!(local * 4 <= full, "{local} of {full}");
    }
}
