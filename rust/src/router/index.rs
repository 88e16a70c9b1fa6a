//! The router's picture of every replica's prefix cache: block hash -> the replicas holding
//! it, built from the replicas' KV events (`kv::events`), batch by batch in sequence-number
//! order. A batch past the next expected number means batches were lost: it is refused
//! (`Applied::Gap`) and the caller replays from the expected number, or rebuilds the replica's
//! part from a snapshot (`apply_snapshot`).
//!
//! Each replica's part is bounded (`set_capacity`: the blocks its cache holds, or
//! `DEFAULT_CAPACITY`): a block stored past the bound is dropped (counted, never indexed), so
//! events that name more blocks than the replica can hold (forged ones, a buggy publisher)
//! cannot grow the router's memory without end.
use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::kv::{IdBuildHasher, KvEventKind};

/// The most replicas one index tracks (one bit each).
pub const MAX_REPLICAS: usize = 64;

/// A replica's bound until its cache size is known: 2^20 blocks (16 M tokens at 16 a block,
/// more than one replica's cache as a rule; about 32 MiB of index at most).
pub const DEFAULT_CAPACITY: usize = 1 << 20;

/// What `apply_batch` did with a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied; the replica now expects `seq + 1`.
    Applied,
    /// Already applied (a replayed or repeated batch): ignored.
    Stale,
    /// Batches before it were lost: nothing applied; replay from `expected`.
    Gap { expected: u64 },
}

#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    /// Block hash -> bit mask of the replicas whose cache holds it.
    blocks: HashMap<u64, u64, IdBuildHasher>,
    /// Per replica: the sequence number of the next batch to apply.
    next_seq: Vec<u64>,
    /// Per replica: the blocks indexed as its, their bound, and the stored blocks dropped for
    /// being past it.
    held: Vec<usize>,
    capacity: Vec<usize>,
    dropped: Vec<u64>,
}

impl PrefixIndex {
    pub fn new(num_replicas: usize) -> Result<Self> {
        if num_replicas == 0 || num_replicas > MAX_REPLICAS {
            return Err(Error::InvalidArgument(format!(
                "num_replicas must be in 1..={MAX_REPLICAS}, got {num_replicas}"
            )));
        }
        Ok(Self {
            blocks: HashMap::default(),
            next_seq: vec![0; num_replicas],
            held: vec![0; num_replicas],
            capacity: vec![DEFAULT_CAPACITY; num_replicas],
            dropped: vec![0; num_replicas],
        })
    }

    /// Bounds `replica`'s part to `blocks` (its cache's size). Blocks it already holds past a
    /// lowered bound stay until removed; no new one is added meanwhile.
    pub fn set_capacity(&mut self, replica: usize, blocks: usize) -> Result<()> {
        self.check_replica(replica)?;
        self.capacity[replica] = blocks;
        Ok(())
    }

    /// `replica`'s part: (blocks indexed, their bound, stored blocks dropped past it so far).
    pub fn replica_usage(&self, replica: usize) -> Result<(usize, usize, u64)> {
        self.check_replica(replica)?;
        Ok((
            self.held[replica],
            self.capacity[replica],
            self.dropped[replica],
        ))
    }

    pub fn num_replicas(&self) -> usize {
        self.next_seq.len()
    }

    pub(crate) fn check_replica(&self, replica: usize) -> Result<()> {
        if replica >= self.num_replicas() {
            return Err(Error::InvalidArgument(format!(
                "replica {replica} out of range (the router has {})",
                self.num_replicas()
            )));
        }
        Ok(())
    }

    /// The sequence number the replica's next batch must carry.
    pub fn next_seq(&self, replica: usize) -> Result<u64> {
        self.check_replica(replica)?;
        Ok(self.next_seq[replica])
    }

    /// Mask of the replicas holding `hash`.
    #[inline]
    pub fn holders(&self, hash: u64) -> u64 {
        self.blocks.get(&hash).copied().unwrap_or(0)
    }

    /// Number of distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Applies batch `seq` of `replica`'s events: record `r` is `kinds[r]` over
    /// `hashes[starts[r]..starts[r + 1]]` (the arrays `kv::KvEventBatch` drains to).
    pub fn apply_batch(
        &mut self,
        replica: usize,
        seq: u64,
        kinds: &[u8],
        starts: &[u32],
        hashes: &[u64],
    ) -> Result<Applied> {
        self.check_replica(replica)?;
        check_records(kinds, starts, hashes.len())?;
        let expected = self.next_seq[replica];
        if seq < expected {
            return Ok(Applied::Stale);
        }
        if seq > expected {
            return Ok(Applied::Gap { expected });
        }
        let bit = 1u64 << replica;
        for (r, &kind) in kinds.iter().enumerate() {
            let records = &hashes[starts[r] as usize..starts[r + 1] as usize];
            match kind {
                k if k == KvEventKind::Stored as u8 => {
                    for &h in records {
                        self.add(replica, h);
                    }
                }
                k if k == KvEventKind::Removed as u8 => {
                    for &h in records {
                        self.drop_bit(h, bit);
                    }
                }
                _ => self.clear_replica(replica),
            }
        }
        self.next_seq[replica] = seq + 1;
        Ok(Applied::Applied)
    }

    /// Marks `hashes` as held by `replica` without an event (the approximate router's record
    /// of what it sent there; outside the event sequence).
    pub fn record(&mut self, replica: usize, hashes: &[u64]) {
        for &h in hashes {
            self.add(replica, h);
        }
    }

    /// Replaces `replica`'s part with `hashes` (its whole cache as of batch `seq`): the next
    /// batch expected is `seq + 1`.
    pub fn apply_snapshot(&mut self, replica: usize, seq: u64, hashes: &[u64]) -> Result<()> {
        self.check_replica(replica)?;
        self.clear_replica(replica);
        for &h in hashes {
            self.add(replica, h);
        }
        self.next_seq[replica] = seq + 1;
        Ok(())
    }

    /// Forgets `replica`'s part and expects its batches from 0 again (a restarted replica).
    pub fn reset_replica(&mut self, replica: usize) -> Result<()> {
        self.check_replica(replica)?;
        self.clear_replica(replica);
        self.next_seq[replica] = 0;
        Ok(())
    }

    /// Every hash `replica` holds (in no order).
    pub fn replica_hashes(&self, replica: usize) -> Result<Vec<u64>> {
        self.check_replica(replica)?;
        let bit = 1u64 << replica;
        Ok(self
            .blocks
            .iter()
            .filter(|(_, &m)| m & bit != 0)
            .map(|(&h, _)| h)
            .collect())
    }

    fn clear_replica(&mut self, replica: usize) {
        let bit = 1u64 << replica;
        self.blocks.retain(|_, m| {
            *m &= !bit;
            *m != 0
        });
        self.held[replica] = 0;
    }

    /// `hash` held by `replica`, unless its part is at its bound (then dropped, counted).
    #[inline]
    fn add(&mut self, replica: usize, hash: u64) {
        let bit = 1u64 << replica;
        let full = self.held[replica] >= self.capacity[replica];
        match self.blocks.entry(hash) {
            Entry::Occupied(e) if *e.get() & bit != 0 => return, // held already
            _ if full => {
                self.dropped[replica] += 1;
                return;
            }
            Entry::Occupied(mut e) => *e.get_mut() |= bit,
            Entry::Vacant(e) => {
                e.insert(bit);
            }
        }
        self.held[replica] += 1;
    }

    #[inline]
    fn drop_bit(&mut self, hash: u64, bit: u64) {
        if let Some(m) = self.blocks.get_mut(&hash) {
            if *m & bit != 0 {
                self.held[bit.trailing_zeros() as usize] -= 1;
            }
            *m &= !bit;
            if *m == 0 {
                self.blocks.remove(&hash);
            }
        }
    }
}

/// `starts` brackets `kinds.len()` records over `num_hashes` hashes, in order.
fn check_records(kinds: &[u8], starts: &[u32], num_hashes: usize) -> Result<()> {
    if starts.len() != kinds.len() + 1 {
        return Err(Error::InvalidArgument(format!(
            "starts must have one more entry than kinds ({}), got {}",
            kinds.len(),
            starts.len()
        )));
    }
    if starts[0] != 0 || starts.windows(2).any(|w| w[0] > w[1]) {
        return Err(Error::InvalidArgument(
            "starts must begin at 0 and never decrease".into(),
        ));
    }
    if starts[kinds.len()] as usize != num_hashes {
        return Err(Error::InvalidArgument(format!(
            "starts ends at {} but {num_hashes} hashes were given",
            starts[kinds.len()]
        )));
    }
    if let Some(&k) = kinds.iter().find(|&&k| k > KvEventKind::AllCleared as u8) {
        return Err(Error::InvalidArgument(format!("unknown event kind {k}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u8 = KvEventKind::Stored as u8;
    const R: u8 = KvEventKind::Removed as u8;
    const C: u8 = KvEventKind::AllCleared as u8;

    #[test]
    fn stored_and_removed_blocks_set_and_clear_the_replicas_bit() {
        let mut ix = PrefixIndex::new(2).unwrap();
        ix.apply_batch(0, 0, &[S], &[0, 2], &[10, 11]).unwrap();
        ix.apply_batch(1, 0, &[S], &[0, 1], &[10]).unwrap();
        assert_eq!((ix.holders(10), ix.holders(11)), (0b11, 0b01));
        ix.apply_batch(0, 1, &[R], &[0, 1], &[10]).unwrap();
        assert_eq!(ix.holders(10), 0b10);
        ix.apply_batch(1, 1, &[C], &[0, 0], &[]).unwrap();
        assert_eq!((ix.holders(10), ix.len()), (0, 1));
    }

    #[test]
    fn a_batch_past_the_expected_number_is_a_gap_and_changes_nothing() {
        let mut ix = PrefixIndex::new(1).unwrap();
        ix.apply_batch(0, 0, &[S], &[0, 1], &[1]).unwrap();
        let r = ix.apply_batch(0, 2, &[S], &[0, 1], &[3]).unwrap();
        assert_eq!(r, Applied::Gap { expected: 1 });
        assert_eq!(ix.holders(3), 0);
        assert_eq!(
            ix.apply_batch(0, 0, &[S], &[0, 1], &[9]).unwrap(),
            Applied::Stale
        );
        assert_eq!(ix.holders(9), 0);
    }

    #[test]
    fn a_snapshot_replaces_the_replicas_part_and_sets_the_next_number() {
        let mut ix = PrefixIndex::new(2).unwrap();
        ix.apply_batch(0, 0, &[S], &[0, 2], &[1, 2]).unwrap();
        ix.apply_batch(1, 0, &[S], &[0, 1], &[1]).unwrap();
        ix.apply_snapshot(0, 41, &[2, 3]).unwrap();
        let mut held = ix.replica_hashes(0).unwrap();
        held.sort_unstable();
        assert_eq!(held, vec![2, 3]);
        assert_eq!(ix.holders(1), 0b10, "the other replica's part is untouched");
        assert_eq!(ix.next_seq(0).unwrap(), 42);
    }

    #[test]
    fn stored_blocks_past_a_replicas_bound_are_dropped_and_counted() {
        let mut ix = PrefixIndex::new(2).unwrap();
        ix.set_capacity(0, 3).unwrap();
        let hashes: Vec<u64> = (100..110).collect();
        ix.apply_batch(0, 0, &[S], &[0, 10], &hashes).unwrap();
        assert_eq!(ix.replica_usage(0).unwrap(), (3, 3, 7));
        assert_eq!(ix.len(), 3, "nothing past the bound is kept");
        // a block stored again, or stored by another replica, takes no room of this one's
        ix.apply_batch(0, 1, &[S], &[0, 1], &[100]).unwrap();
        ix.apply_batch(1, 0, &[S], &[0, 2], &[105, 106]).unwrap();
        assert_eq!(ix.replica_usage(0).unwrap(), (3, 3, 7));
        // a removal makes room again
        ix.apply_batch(0, 2, &[R, S], &[0, 1, 2], &[100, 105])
            .unwrap();
        assert_eq!((ix.holders(100), ix.holders(105)), (0, 0b11));
        assert_eq!(ix.replica_usage(0).unwrap().0, 3);
    }

    #[test]
    fn a_snapshot_and_a_clear_keep_the_count_of_held_blocks_exact() {
        let mut ix = PrefixIndex::new(1).unwrap();
        ix.set_capacity(0, 4).unwrap();
        ix.apply_snapshot(0, 5, &[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(ix.replica_usage(0).unwrap(), (4, 4, 2));
        ix.apply_batch(0, 6, &[C, S], &[0, 0, 2], &[7, 8]).unwrap();
        assert_eq!(ix.replica_usage(0).unwrap().0, 2);
        ix.reset_replica(0).unwrap();
        assert_eq!((ix.replica_usage(0).unwrap().0, ix.len()), (0, 0));
        assert_eq!(
            PrefixIndex::new(1).unwrap().replica_usage(0).unwrap().1,
            DEFAULT_CAPACITY
        );
    }

    #[test]
    fn malformed_records_are_refused_naming_what_is_wrong() {
        let mut ix = PrefixIndex::new(1).unwrap();
        let e = ix.apply_batch(0, 0, &[S], &[0], &[]).unwrap_err();
        assert!(e.to_string().contains("one more entry"), "{e}");
        let e = ix.apply_batch(0, 0, &[S], &[0, 2], &[1]).unwrap_err();
        assert!(e.to_string().contains("hashes were given"), "{e}");
        let e = ix.apply_batch(0, 0, &[7], &[0, 0], &[]).unwrap_err();
        assert!(e.to_string().contains("kind 7"), "{e}");
        assert!(ix.apply_batch(3, 0, &[], &[0], &[]).is_err());
        assert!(PrefixIndex::new(65).is_err());
    }
}
