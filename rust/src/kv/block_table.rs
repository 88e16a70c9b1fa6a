//! A sequence's block table: logical block i -> physical block, plus the chain of full-block
//! hashes known so far (for prefix-cache registration).
use crate::ids::BlockId;

/// Which pool a table's blocks live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    Device,
    Host,
}

#[derive(Debug, Clone)]
pub struct BlockTable {
    /// Physical block ids, in the pool given by `location`.
    pub blocks: Vec<BlockId>,
    /// Chain hashes of the first `hashes.len()` full blocks of the sequence's tokens.
    pub hashes: Vec<u64>,
    /// Leading blocks already offered to the prefix cache (hits count as offered).
    pub num_registered: usize,
    pub location: Location,
}

impl BlockTable {
    pub fn new(blocks: Vec<BlockId>, hashes: Vec<u64>, num_registered: usize) -> Self {
        Self {
            blocks,
            hashes,
            num_registered,
            location: Location::Device,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Token slots the table covers.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// KV slot of token `t`: `table[t / bs] * bs + t % bs`; `None` beyond the table.
    pub fn slot(&self, token_index: usize, block_size: usize) -> Option<usize> {
        let block = *self.blocks.get(token_index / block_size)?;
        Some(block as usize * block_size + token_index % block_size)
    }
}

/// Blocks needed to hold `num_slots` token slots.
#[inline]
pub fn blocks_for(num_slots: usize, block_size: usize) -> usize {
    num_slots.div_ceil(block_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_follows_the_table() {
        let t = BlockTable::new(vec![7, 2], vec![], 0);
        assert_eq!(t.slot(0, 4), Some(28));
        assert_eq!(t.slot(3, 4), Some(31));
        assert_eq!(t.slot(5, 4), Some(9));
        assert_eq!(t.slot(8, 4), None);
        assert_eq!(t.capacity(4), 8);
        assert_eq!(t.location, Location::Device);
    }

    #[test]
    fn blocks_for_rounds_up() {
        assert_eq!(blocks_for(0, 16), 0);
        assert_eq!(blocks_for(1, 16), 1);
        assert_eq!(blocks_for(16, 16), 1);
        assert_eq!(blocks_for(17, 16), 2);
    }
}
