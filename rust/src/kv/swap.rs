//! Swap: a group of sequences (sharing blocks among themselves) moves its blocks to the host
//! pool and back, each distinct block once so the sharing survives.
use std::collections::{HashMap, HashSet};

use super::admission::{AllocStatus, Ask};
use super::block_table::{blocks_for, Location, NULL_BLOCK};
use super::manager::{
    broken_free_count, release_device_block, take_checked_device_block, KvCacheManager,
};
use super::prefix_cache::IdBuildHasher;
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};

/// Old block -> new block of one swap.
type BlockMap = HashMap<BlockId, BlockId, IdBuildHasher>;

/// Gives each of `distinct` (old blocks) a new block from `take`: the old -> new map and the
/// (old, new) copy pairs in the order of `distinct`.
fn pair_blocks(
    distinct: &[BlockId],
    mut take: impl FnMut() -> Result<BlockId>,
) -> Result<(BlockMap, Vec<(BlockId, BlockId)>)> {
    let mut mapping = BlockMap::with_capacity_and_hasher(distinct.len(), IdBuildHasher::default());
    let mut pairs = Vec::with_capacity(distinct.len());
    for &old in distinct {
        let new = take()?;
        mapping.insert(old, new);
        pairs.push((old, new));
    }
    Ok((mapping, pairs))
}

impl KvCacheManager {
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
            for block in table.held_blocks() {
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
        Ok(self.group_blocks(seqs, Location::Device)?.len() <= self.host.num_free())
    }

    /// `check_swap_out`, with any error answered `false`.
    pub fn can_swap_out(&self, seqs: &[SeqId]) -> bool {
        self.check_swap_out(seqs).unwrap_or(false)
    }

    /// Moves the group's device blocks to host blocks, each distinct block once (sharing kept),
    /// and releases the device blocks. Returns the (device, host) copy pairs.
    pub fn swap_out(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let distinct = self.group_blocks(seqs, Location::Device)?;
        if distinct.len() > self.host.num_free() {
            return Err(Error::OutOfHostBlocks {
                needed: distinct.len(),
                free: self.host.num_free(),
            });
        }
        let host = &mut self.host;
        let (mapping, pairs) = pair_blocks(&distinct, || {
            host.pop_free().ok_or_else(|| broken_free_count("host"))
        })?;
        for &seq in seqs {
            let Some(table) = self.tables.get_mut(&seq) else {
                continue;
            };
            for row in table.rows_mut() {
                for block in row.iter_mut().rev().filter(|b| **b != NULL_BLOCK) {
                    let host = mapping[block];
                    self.host.incref(host);
                    release_device_block(&mut self.device, &self.prefix_cache, *block);
                    *block = host;
                }
            }
            table.location = Location::Host;
        }
        // pop_free's initial reference was only a placeholder for the table references.
        for &(_, host) in &pairs {
            self.host.decref(host, false);
        }
        Ok(pairs)
    }

    /// What swapping a group of `blocks` distinct blocks back in (and growing it by what is
    /// counted in them) asks of the device pool; `keep_watermark`: the watermark stays free.
    fn swap_in_admission(&self, blocks: usize, keep_watermark: bool) -> AllocStatus {
        self.admission(Ask {
            total: blocks,
            taken: blocks,
            off_limits: 0,
            reserve: if keep_watermark {
                self.watermark_blocks
            } else {
                0
            },
        })
    }

    /// OK / LATER / NEVER for swapping the group back in, plus `num_lookahead_slots` per
    /// sequence (errors for unknown, repeated or not swapped-out sequences).
    pub fn check_swap_in(&self, seqs: &[SeqId], num_lookahead_slots: usize) -> Result<AllocStatus> {
        let distinct = self.group_blocks(seqs, Location::Host)?.len();
        let lookahead = seqs.len()
            * blocks_for(num_lookahead_slots, self.config.block_size)
            * self.windows.len();
        Ok(self.swap_in_admission(distinct + lookahead, true))
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
        match self.group_blocks(seqs, Location::Host) {
            Ok(distinct) => self.swap_in_admission(distinct.len() + extra_blocks, keep_watermark),
            Err(_) => AllocStatus::Never,
        }
    }

    /// Moves the group's host blocks back to device blocks (sharing kept) and frees the host
    /// blocks. Returns the (host, device) copy pairs.
    pub fn swap_in(&mut self, seqs: &[SeqId]) -> Result<Vec<(BlockId, BlockId)>> {
        let distinct = self.group_blocks(seqs, Location::Host)?;
        if distinct.len() > self.device.num_free() {
            return Err(Error::OutOfDeviceBlocks {
                needed: distinct.len(),
                free: self.device.num_free(),
            });
        }
        let (device, cache) = (&mut self.device, &mut self.prefix_cache);
        let (mapping, pairs) = pair_blocks(&distinct, || take_checked_device_block(device, cache))?;
        for &seq in seqs {
            let Some(table) = self.tables.get_mut(&seq) else {
                continue;
            };
            for row in table.rows_mut() {
                for block in row.iter_mut().filter(|b| **b != NULL_BLOCK) {
                    let device = mapping[block];
                    self.device.incref(device);
                    self.host.decref(*block, false);
                    *block = device;
                }
            }
            table.location = Location::Device;
            // Fresh device blocks are unregistered: offer them to the cache again.
            table.num_registered = 0;
        }
        for &(_, device) in &pairs {
            self.device.decref(device, false);
        }
        Ok(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::super::{CacheConfig, KvCacheManager};
    use super::*;

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
        assert_eq!(m.num_free_device_blocks(), 8);
        assert_eq!(m.num_free_host_blocks(), 5);
        let h1 = m.block_table(1).unwrap().to_vec();
        let h2 = m.block_table(2).unwrap().to_vec();
        assert_eq!(h1[0], h2[0]);
        assert_eq!(m.host_ref_count(h1[0]), Some(2));
        assert_eq!(m.can_swap_in(&[1, 2], 0), AllocStatus::Ok);
        let back = m.swap_in(&[1, 2]).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(m.num_free_host_blocks(), 8);
        let d1 = m.block_table(1).unwrap().to_vec();
        let d2 = m.block_table(2).unwrap().to_vec();
        assert_eq!(d1[0], d2[0]);
        assert_eq!(m.device_ref_count(d1[0]), Some(2));
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
            num_device_blocks: 10,
            num_host_blocks: 10,
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
        assert_eq!(m.num_free_host_blocks(), 2);
        m.free(2).unwrap();
        assert_eq!(m.num_free_host_blocks(), 4);
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
        assert_eq!(m.device_ref_count(0), Some(1));
        m.swap_in(&[2]).unwrap();
        // Swapped-in copies are re-offered to the cache; the originals keep their mapping.
        assert_eq!(m.cache_full_blocks(2, &p, 5, 0).unwrap(), 0);
        m.check_invariants().unwrap();
    }
}
