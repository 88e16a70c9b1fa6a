//! A sequence's block table: logical block i -> physical block, plus the chain of full-block
//! hashes known so far (for prefix-cache registration). A hybrid manager (`groups.rs`) gives
//! each layer group its own row of blocks over the same logical positions.
use crate::ids::BlockId;

/// A table entry whose block a sliding-window group released (wholly outside its window) or
/// never took: it holds no block of any pool.
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// Which pool a table's blocks live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    Device,
    Host,
}

#[derive(Debug, Clone)]
pub struct BlockTable {
    /// Physical block ids of layer group 0, in the pool given by `location`.
    pub blocks: Vec<BlockId>,
    /// Groups 1.. of a hybrid manager (empty otherwise): rows as long as `blocks`, where a
    /// sliding-window group has `NULL_BLOCK` for the blocks it released.
    pub others: Vec<Vec<BlockId>>,
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
            others: Vec::new(),
            hashes,
            num_registered,
            location: Location::Device,
        }
    }

    /// Group `g`'s row (0: `blocks`).
    #[inline]
    pub fn group(&self, g: usize) -> &[BlockId] {
        if g == 0 {
            &self.blocks
        } else {
            &self.others[g - 1]
        }
    }

    /// Every group's row, group 0 first.
    pub fn rows(&self) -> impl Iterator<Item = &Vec<BlockId>> {
        std::iter::once(&self.blocks).chain(&self.others)
    }

    /// Every group's row, mutably, group 0 first.
    pub fn rows_mut(&mut self) -> impl Iterator<Item = &mut Vec<BlockId>> {
        std::iter::once(&mut self.blocks).chain(&mut self.others)
    }

    /// The blocks held, every group, `NULL_BLOCK` entries left out.
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.rows()
            .flat_map(|r| r.iter().copied())
            .filter(|&b| b != NULL_BLOCK)
    }

    /// How many blocks the table holds, every group (what a sequence costs the pool).
    pub fn num_held_blocks(&self) -> usize {
        self.held_blocks().count()
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
