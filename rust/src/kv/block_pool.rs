//! One pool of KV-cache blocks (device or host).
//!
//! A block is in exactly one of three states:
//! - `Free`: never used, or released without a cached hash; kept on a LIFO free stack.
//! - `Cached`: ref count 0 but its contents are registered in the prefix cache; kept on an
//!   intrusive doubly-linked LRU list (head = evicted first) so that a prefix hit can revive a
//!   block from the middle of the list in O(1).
//! - `InUse`: ref count > 0.
//!
//! Every operation is O(1). The pool knows nothing about hashes: the caller says, when a block's
//! last reference goes, whether it is registered (and so goes to the LRU list) or not.
use crate::error::{block_violation, Error, Result};
use crate::ids::BlockId;

/// Link value meaning "no block".
const NIL: BlockId = BlockId::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    Free,
    Cached,
    InUse,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    state: Vec<BlockState>,
    free_stack: Vec<BlockId>,
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    lru_head: BlockId,
    lru_tail: BlockId,
    num_cached: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks with ids `0..num_blocks`.
    pub fn new(num_blocks: usize) -> Result<Self> {
        if num_blocks >= NIL as usize {
            return Err(Error::InvalidArgument(format!(
                "number of blocks {num_blocks} exceeds the maximum {}",
                NIL as usize - 1
            )));
        }
        Ok(Self {
            ref_counts: vec![0; num_blocks],
            state: vec![BlockState::Free; num_blocks],
            // Reversed so that blocks are handed out in increasing id order (easier to read
            // in tests and logs; also keeps early allocations at low addresses).
            free_stack: (0..num_blocks as BlockId).rev().collect(),
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            lru_head: NIL,
            lru_tail: NIL,
            num_cached: 0,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Free blocks, counting cached (evictable) ones.
    pub fn num_free(&self) -> usize {
        self.free_stack.len() + self.num_cached
    }

    /// Free blocks that hold nothing worth keeping (taken before any cached block is evicted).
    pub fn num_uncached_free(&self) -> usize {
        self.free_stack.len()
    }

    /// Blocks with ref count 0 that still hold registered prefix-cache contents.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    pub fn num_in_use(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// `None` for an id outside the pool.
    pub fn ref_count(&self, block: BlockId) -> Option<u32> {
        self.ref_counts.get(block as usize).copied()
    }

    /// `None` for an id outside the pool.
    pub fn state(&self, block: BlockId) -> Option<BlockState> {
        self.state.get(block as usize).copied()
    }

    /// Takes an uncached free block (ref count becomes 1).
    pub fn pop_free(&mut self) -> Option<BlockId> {
        let block = self.free_stack.pop()?;
        self.ref_counts[block as usize] = 1;
        self.state[block as usize] = BlockState::InUse;
        Some(block)
    }

    /// Evicts the least recently released cached block (ref count becomes 1). The caller must
    /// drop the block's prefix-cache registration.
    pub fn pop_lru(&mut self) -> Option<BlockId> {
        let block = self.lru_head;
        if block == NIL {
            return None;
        }
        self.unlink(block);
        self.ref_counts[block as usize] = 1;
        self.state[block as usize] = BlockState::InUse;
        Some(block)
    }

    /// Adds a reference. A cached block is revived: taken out of the LRU list with ref count 1.
    pub fn incref(&mut self, block: BlockId) {
        let b = block as usize;
        match self.state[b] {
            BlockState::InUse => self.ref_counts[b] += 1,
            BlockState::Cached => {
                self.unlink(block);
                self.ref_counts[b] = 1;
                self.state[b] = BlockState::InUse;
            }
            BlockState::Free => {
                debug_assert!(false, "incref of free block {block}");
            }
        }
    }

    /// Drops a reference and returns the remaining count. At zero the block goes to the tail
    /// of the LRU list when `cached` (its contents stay reusable), otherwise to the free stack.
    pub fn decref(&mut self, block: BlockId, cached: bool) -> u32 {
        let b = block as usize;
        debug_assert!(
            self.state[b] == BlockState::InUse && self.ref_counts[b] > 0,
            "decref of unreferenced block {block}"
        );
        if self.state[b] != BlockState::InUse || self.ref_counts[b] == 0 {
            return 0;
        }
        self.ref_counts[b] -= 1;
        if self.ref_counts[b] == 0 {
            if cached {
                self.push_lru_tail(block);
            } else {
                self.state[b] = BlockState::Free;
                self.free_stack.push(block);
            }
        }
        self.ref_counts[b]
    }

    /// Moves a cached block to the free stack (its registration was dropped).
    pub fn uncache(&mut self, block: BlockId) {
        if self.state[block as usize] == BlockState::Cached {
            self.unlink(block);
            self.state[block as usize] = BlockState::Free;
            self.free_stack.push(block);
        }
    }

    /// Cached blocks in eviction order (head first).
    pub fn lru_order(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_cached);
        let mut cur = self.lru_head;
        while cur != NIL && out.len() <= self.num_cached {
            out.push(cur);
            cur = self.next[cur as usize];
        }
        out
    }

    fn push_lru_tail(&mut self, block: BlockId) {
        let b = block as usize;
        self.state[b] = BlockState::Cached;
        self.prev[b] = self.lru_tail;
        self.next[b] = NIL;
        if self.lru_tail == NIL {
            self.lru_head = block;
        } else {
            self.next[self.lru_tail as usize] = block;
        }
        self.lru_tail = block;
        self.num_cached += 1;
    }

    fn unlink(&mut self, block: BlockId) {
        let b = block as usize;
        let (p, n) = (self.prev[b], self.next[b]);
        if p == NIL {
            self.lru_head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.lru_tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.num_cached -= 1;
    }

    /// Structural invariants: every block in exactly one place, counts add up, links agree.
    /// `name` labels messages ("device" / "host").
    pub fn check(&self, name: &str) -> std::result::Result<(), String> {
        let n = self.num_blocks();
        let mut on_free_stack = vec![false; n];
        for &block in &self.free_stack {
            let b = block as usize;
            if b >= n {
                return Err(format!(
                    "{name} free stack holds out-of-range block {block}"
                ));
            }
            if on_free_stack[b] {
                return Err(block_violation(name, block, "on the free stack twice"));
            }
            on_free_stack[b] = true;
            if self.state[b] != BlockState::Free {
                return Err(block_violation(
                    name,
                    block,
                    "on the free stack but not free",
                ));
            }
        }
        let order = self.lru_order();
        if order.len() != self.num_cached {
            return Err(format!(
                "{name} LRU list has {} blocks, counter says {}",
                order.len(),
                self.num_cached
            ));
        }
        let mut prev = NIL;
        for &block in &order {
            let b = block as usize;
            if self.state[b] != BlockState::Cached {
                return Err(block_violation(
                    name,
                    block,
                    "on the LRU list but not cached",
                ));
            }
            if self.prev[b] != prev {
                return Err(block_violation(name, block, "LRU back link broken"));
            }
            prev = block;
        }
        if self.lru_tail != prev {
            return Err(format!("{name} LRU tail is not the last listed block"));
        }
        let (mut free, mut cached, mut in_use) = (0, 0, 0);
        for (b, &state) in self.state.iter().enumerate() {
            let block = b as BlockId;
            match state {
                BlockState::Free => {
                    free += 1;
                    if !on_free_stack[b] {
                        return Err(block_violation(
                            name,
                            block,
                            "free but not on the free stack",
                        ));
                    }
                    if self.ref_counts[b] != 0 {
                        return Err(block_violation(
                            name,
                            block,
                            "free with a nonzero ref count",
                        ));
                    }
                }
                BlockState::Cached => {
                    cached += 1;
                    if self.ref_counts[b] != 0 {
                        return Err(block_violation(
                            name,
                            block,
                            "cached with a nonzero ref count",
                        ));
                    }
                }
                BlockState::InUse => {
                    in_use += 1;
                    if self.ref_counts[b] == 0 {
                        return Err(block_violation(name, block, "in use with ref count 0"));
                    }
                }
            }
        }
        if free + cached + in_use != n || self.num_free() + self.num_in_use() != n {
            return Err(format!(
                "{name} pool: free {free} + cached {cached} + in use {in_use} != total {n}"
            ));
        }
        if cached != self.num_cached {
            return Err(format!(
                "{name} pool: {cached} cached blocks, counter says {}",
                self.num_cached
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_pool_hands_out_blocks_in_id_order() {
        let mut pool = BlockPool::new(3).unwrap();
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.pop_free(), Some(0));
        assert_eq!(pool.pop_free(), Some(1));
        assert_eq!(pool.pop_free(), Some(2));
        assert_eq!(pool.pop_free(), None);
        assert_eq!(pool.num_in_use(), 3);
        pool.check("device").unwrap();
    }

    #[test]
    fn decref_to_zero_frees_or_caches() {
        let mut pool = BlockPool::new(2).unwrap();
        let a = pool.pop_free().unwrap();
        let b = pool.pop_free().unwrap();
        pool.incref(a);
        assert_eq!(pool.ref_count(a), Some(2));
        assert_eq!(pool.decref(a, false), 1);
        assert_eq!(pool.decref(a, false), 0);
        assert_eq!(pool.state(a), Some(BlockState::Free));
        assert_eq!(pool.decref(b, true), 0);
        assert_eq!(pool.state(b), Some(BlockState::Cached));
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.num_cached(), 1);
        pool.check("device").unwrap();
    }

    #[test]
    fn uncached_free_blocks_are_taken_before_cached_ones() {
        let mut pool = BlockPool::new(2).unwrap();
        let a = pool.pop_free().unwrap();
        pool.decref(a, true);
        // pop_free never touches the LRU list.
        let b = pool.pop_free().unwrap();
        assert_ne!(a, b);
        assert_eq!(pool.pop_free(), None);
        assert_eq!(pool.pop_lru(), Some(a));
        pool.check("device").unwrap();
    }

    #[test]
    fn lru_evicts_least_recently_released_first() {
        let mut pool = BlockPool::new(4).unwrap();
        let ids: Vec<_> = (0..4).map(|_| pool.pop_free().unwrap()).collect();
        for &b in &[ids[2], ids[0], ids[3], ids[1]] {
            pool.decref(b, true);
        }
        assert_eq!(pool.lru_order(), vec![ids[2], ids[0], ids[3], ids[1]]);
        assert_eq!(pool.pop_lru(), Some(ids[2]));
        assert_eq!(pool.pop_lru(), Some(ids[0]));
        pool.check("device").unwrap();
    }

    #[test]
    fn revive_from_the_middle_of_the_lru_list() {
        let mut pool = BlockPool::new(3).unwrap();
        let ids: Vec<_> = (0..3).map(|_| pool.pop_free().unwrap()).collect();
        for &b in &ids {
            pool.decref(b, true);
        }
        pool.incref(ids[1]);
        assert_eq!(pool.ref_count(ids[1]), Some(1));
        assert_eq!(pool.state(ids[1]), Some(BlockState::InUse));
        assert_eq!(pool.lru_order(), vec![ids[0], ids[2]]);
        pool.check("device").unwrap();
        // Head and tail revivals keep the links right too.
        pool.incref(ids[0]);
        pool.incref(ids[2]);
        assert!(pool.lru_order().is_empty());
        pool.check("device").unwrap();
    }

    #[test]
    fn uncache_moves_a_cached_block_to_the_free_stack() {
        let mut pool = BlockPool::new(2).unwrap();
        let a = pool.pop_free().unwrap();
        pool.decref(a, true);
        pool.uncache(a);
        assert_eq!(pool.state(a), Some(BlockState::Free));
        assert_eq!(pool.num_cached(), 0);
        assert_eq!(pool.num_uncached_free(), 2);
        pool.check("device").unwrap();
    }

    #[test]
    fn out_of_range_ids_give_none() {
        let pool = BlockPool::new(1).unwrap();
        assert_eq!(pool.ref_count(5), None);
        assert_eq!(pool.state(5), None);
    }

    #[test]
    fn empty_pool_is_valid() {
        let mut pool = BlockPool::new(0).unwrap();
        assert_eq!(pool.pop_free(), None);
        assert_eq!(pool.pop_lru(), None);
        pool.check("host").unwrap();
    }
}
