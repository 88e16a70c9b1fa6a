//! Giving back the tail of a table: speculative decoding allocates slots for draft tokens, and
//! the blocks that end up holding only rejected drafts return to the pool.
use crate::error::{Error, Result};
use crate::ids::SeqId;

use super::block_table::{blocks_for, NULL_BLOCK};
use super::manager::{device_table_mut, release_device_block};
use super::KvCacheManager;

impl KvCacheManager {
    /// Shrinks a device-resident table to the blocks that hold its first `num_slots` slots,
    /// releasing the rest (last first); returns how many were released. Blocks already offered
    /// to the prefix cache are never released this way (an `InvalidArgument`, nothing
    /// changed): they hold computed tokens.
    pub fn truncate_slots(&mut self, seq: SeqId, num_slots: usize) -> Result<usize> {
        let keep = blocks_for(num_slots, self.config.block_size);
        let table = device_table_mut(&mut self.tables, seq)?;
        if keep >= table.blocks.len() {
            return Ok(0);
        }
        if keep < table.num_registered {
            return Err(Error::InvalidArgument(format!(
                "truncating sequence {seq} to {keep} blocks would release {} blocks offered to \
                 the prefix cache",
                table.num_registered - keep
            )));
        }
        let mut released = 0;
        for row in table.rows_mut() {
            for &block in row[keep..].iter().rev().filter(|&&b| b != NULL_BLOCK) {
                release_device_block(&mut self.device, &self.prefix_cache, block);
                released += 1;
            }
            row.truncate(keep);
        }
        table.hashes.truncate(keep);
        Ok(released)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};

    #[test]
    fn truncate_releases_the_tail_blocks() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..5));
        m.append_slots(1, 5, 13).unwrap().unwrap();
        assert_eq!(m.block_table(1).unwrap().len(), 4);
        let free = m.num_free_device_blocks();
        assert_eq!(m.truncate_slots(1, 6).unwrap(), 2);
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        assert_eq!(m.num_free_device_blocks(), free + 2);
        assert_eq!(m.truncate_slots(1, 8).unwrap(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn truncate_never_drops_registered_blocks() {
        let mut m = manager(4, 8, 0);
        alloc(&mut m, 1, &toks(0..9));
        m.cache_full_blocks(1, &toks(0..9), 8, 0).unwrap();
        assert!(m.truncate_slots(1, 4).is_err());
        assert_eq!(m.block_table(1).unwrap().len(), 3);
        assert!(m.truncate_slots(7, 4).is_err());
    }
}
