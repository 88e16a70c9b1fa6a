//! Sharing: `fork` (a child table sharing every block of its parent), `free`, and the
//! copy-on-write of shared blocks that `append_slots` runs before a sequence writes into them.
use super::block_pool::BlockPool;
use super::block_table::{Location, NULL_BLOCK};
use super::manager::{release_device_block, take_checked_device_block, KvCacheManager};
use super::prefix_cache::PrefixCache;
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};

/// Blocks among `blocks` that another table shares (a write into one needs a copy first).
pub(super) fn count_shared_blocks(pool: &BlockPool, blocks: &[BlockId]) -> usize {
    blocks
        .iter()
        .filter(|&&b| pool.ref_count(b).unwrap_or(0) > 1)
        .count()
}

/// Copy-on-write: replaces every shared block among `blocks` (a table's blocks about to be
/// written) by a fresh device block, dropping one reference to the original, and lists the
/// (src, dst) pairs in `copies`. The caller checked that the free blocks suffice.
pub(super) fn copy_shared_blocks(
    pool: &mut BlockPool,
    cache: &mut PrefixCache,
    blocks: &mut [BlockId],
    copies: &mut Vec<(BlockId, BlockId)>,
) -> Result<()> {
    for block in blocks {
        let src = *block;
        if pool.ref_count(src).unwrap_or(0) > 1 {
            let dst = take_checked_device_block(pool, cache)?;
            // ref > 1, so this never releases `src`.
            pool.decref(src, true);
            *block = dst;
            copies.push((src, dst));
        }
    }
    Ok(())
}

impl KvCacheManager {
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
            Location::Device => &mut self.device,
            Location::Host => &mut self.host,
        };
        for block in table.held_blocks() {
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
            Location::Device if self.hybrid => {
                for row in table.rows() {
                    for &block in row.iter().rev().filter(|&&b| b != NULL_BLOCK) {
                        release_device_block(&mut self.device, &self.prefix_cache, block);
                    }
                }
            }
            Location::Device => {
                for &block in table.blocks.iter().rev() {
                    release_device_block(&mut self.device, &self.prefix_cache, block);
                }
            }
            Location::Host => {
                for row in table.rows() {
                    for &block in row.iter().rev().filter(|&&b| b != NULL_BLOCK) {
                        self.host.decref(block, false);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::*;

    #[test]
    fn fork_shares_blocks_and_append_copies_on_write() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..6));
        m.fork(1, 2).unwrap();
        assert_eq!(m.device_ref_count(0), Some(2));
        assert_eq!(m.device_ref_count(1), Some(2));
        // Writing slot 6 lands in shared block 1: copy it, keep full block 0 shared.
        let copies = m.append_slots(2, 6, 7).unwrap().unwrap();
        assert_eq!(copies, vec![(1, 2)]);
        assert_eq!(m.block_table(2).unwrap(), &[0, 2]);
        assert_eq!(m.device_ref_count(1), Some(1));
        assert_eq!(m.device_ref_count(0), Some(2));
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
        assert_eq!(m.device_ref_count(0), Some(1));
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_returns_blocks_and_double_free_is_an_error() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..6));
        m.fork(1, 2).unwrap();
        m.free(1).unwrap();
        assert_eq!(m.num_free_device_blocks(), 6);
        m.free(2).unwrap();
        assert_eq!(m.num_free_device_blocks(), 8);
        assert_eq!(m.free(2), Err(Error::UnknownSequence(2)));
        m.check_invariants().unwrap();
    }
}
