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
//!
//! Blocks are indexed per medium (`kv::events::Medium`): the device cache, and the offload
//! tiers in host memory and on disk, which a replica loads a prefix from instead of computing
//! it again. `holders` is the device's; `tier_holders` the tiers'. A tier's part of a replica
//! is bounded by `DEFAULT_CAPACITY`. `AllBlocksCleared` empties every medium of the replica
//! (what the router then does not know it counts as recompute). Media are vLLM's: `GPU` (or
//! none) is the device cache on every platform (a CPU engine's too), `CPU` the host tier.
use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::kv::events::Medium;
use crate::kv::{IdBuildHasher, KvEventKind};

const MEDIA: usize = Medium::ALL.len();

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
    /// Per medium: block hash -> bit mask of the replicas holding it there.
    blocks: [HashMap<u64, u64, IdBuildHasher>; MEDIA],
    /// Per replica: the sequence number of the next batch to apply.
    next_seq: Vec<u64>,
    /// Per replica: the blocks indexed as its (per medium), the device's bound, and the stored
    /// blocks dropped for being past a bound.
    held: Vec<[usize; MEDIA]>,
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
            blocks: Default::default(),
            next_seq: vec![0; num_replicas],
            held: vec![[0; MEDIA]; num_replicas],
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

    /// `replica`'s part: (device blocks indexed, their bound, stored blocks dropped past a
    /// bound so far).
    pub fn replica_usage(&self, replica: usize) -> Result<(usize, usize, u64)> {
        self.check_replica(replica)?;
        Ok((
            self.held[replica][Medium::Device as usize],
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

    /// Mask of the replicas whose device cache holds `hash`.
    #[inline]
    pub fn holders(&self, hash: u64) -> u64 {
        self.blocks[0].get(&hash).copied().unwrap_or(0)
    }

    /// Masks of the replicas whose host tier, and whose disk tier, hold `hash`.
    #[inline]
    pub fn tier_holders(&self, hash: u64) -> (u64, u64) {
        let get = |m: Medium| self.blocks[m as usize].get(&hash).copied().unwrap_or(0);
        (get(Medium::Host), get(Medium::Disk))
    }

    /// Whether any replica's offload tier holds a block (else `tier_holders` is all 0).
    pub fn has_tier_blocks(&self) -> bool {
        self.blocks[1..].iter().any(|m| !m.is_empty())
    }

    /// `replica`'s blocks indexed on `medium`.
    pub fn num_blocks_on(&self, replica: usize, medium: Medium) -> usize {
        self.held.get(replica).map_or(0, |h| h[medium as usize])
    }

    /// Number of distinct device blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks[0].len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks[0].is_empty()
    }

    /// Applies batch `seq` of `replica`'s events: record `r` is `kinds[r]` over
    /// `hashes[starts[r]..starts[r + 1]]` (the arrays `kv::KvEventBatch` drains to), every
    /// record the device cache's.
    pub fn apply_batch(
        &mut self,
        replica: usize,
        seq: u64,
        kinds: &[u8],
        starts: &[u32],
        hashes: &[u64],
    ) -> Result<Applied> {
        self.apply_batch_on(replica, seq, kinds, starts, hashes, &[])
    }

    /// `apply_batch` with record `r` on medium `media[r]` (a `Medium` code; empty: all the
    /// device's).
    pub fn apply_batch_on(
        &mut self,
        replica: usize,
        seq: u64,
        kinds: &[u8],
        starts: &[u32],
        hashes: &[u64],
        media: &[u8],
    ) -> Result<Applied> {
        self.check_replica(replica)?;
        check_records(kinds, starts, hashes.len())?;
        let media = check_media(media, kinds.len())?;
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
            let medium = Self::medium(media.get(r).copied());
            match kind {
                k if k == KvEventKind::Stored as u8 => {
                    for &h in records {
                        self.add(replica, h, medium);
                    }
                }
                k if k == KvEventKind::Removed as u8 => {
                    for &h in records {
                        self.drop_bit(h, bit, medium);
                    }
                }
                _ => self.clear_replica(replica),
            }
        }
        self.next_seq[replica] = seq + 1;
        Ok(Applied::Applied)
    }

    /// Replaces `replica`'s part with `hashes` (its whole cache as of batch `seq`): the next
    /// batch expected is `seq + 1`.
    pub fn apply_snapshot(&mut self, replica: usize, seq: u64, hashes: &[u64]) -> Result<()> {
        self.apply_snapshot_on(replica, seq, hashes, &[])
    }

    /// `apply_snapshot` with hash `i` on medium `media[i]` (empty: all on the device).
    pub fn apply_snapshot_on(
        &mut self,
        replica: usize,
        seq: u64,
        hashes: &[u64],
        media: &[u8],
    ) -> Result<()> {
        self.check_replica(replica)?;
        let media = check_media(media, hashes.len())?;
        self.clear_replica(replica);
        for (i, &h) in hashes.iter().enumerate() {
            self.add(replica, h, Self::medium(media.get(i).copied()));
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

    /// Every hash `replica`'s device cache holds (in no order).
    pub fn replica_hashes(&self, replica: usize) -> Result<Vec<u64>> {
        self.check_replica(replica)?;
        let bit = 1u64 << replica;
        Ok(self.blocks[0]
            .iter()
            .filter(|(_, &m)| m & bit != 0)
            .map(|(&h, _)| h)
            .collect())
    }

    /// Where a block published on medium code `m` (None: the device) is indexed.
    #[inline]
    fn medium(m: Option<u8>) -> usize {
        m.map_or(0, usize::from)
    }

    fn clear_replica(&mut self, replica: usize) {
        let bit = 1u64 << replica;
        for (medium, blocks) in self.blocks.iter_mut().enumerate() {
            if self.held[replica][medium] == 0 {
                continue;
            }
            blocks.retain(|_, m| {
                *m &= !bit;
                *m != 0
            });
            self.held[replica][medium] = 0;
        }
    }

    /// `hash` held by `replica` on `medium`, unless its part there is at its bound (then
    /// dropped, counted).
    #[inline]
    fn add(&mut self, replica: usize, hash: u64, medium: usize) {
        let bit = 1u64 << replica;
        let bound = if medium == 0 {
            self.capacity[replica]
        } else {
            DEFAULT_CAPACITY
        };
        let full = self.held[replica][medium] >= bound;
        match self.blocks[medium].entry(hash) {
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
        self.held[replica][medium] += 1;
    }

    #[inline]
    fn drop_bit(&mut self, hash: u64, bit: u64, medium: usize) {
        if let Some(m) = self.blocks[medium].get_mut(&hash) {
            if *m & bit != 0 {
                self.held[bit.trailing_zeros() as usize][medium] -= 1;
            }
            *m &= !bit;
            if *m == 0 {
                self.blocks[medium].remove(&hash);
            }
        }
    }
}

/// `media` names a known medium per entry (`n` of them), or is empty (all the device's).
fn check_media(media: &[u8], n: usize) -> Result<&[u8]> {
    if !media.is_empty() && media.len() != n {
        return Err(Error::InvalidArgument(format!(
            "media must hold one medium per entry ({n}), got {}",
            media.len()
        )));
    }
    if let Some(&m) = media.iter().find(|&&m| Medium::from_code(m).is_none()) {
        return Err(Error::InvalidArgument(format!("unknown medium code {m}")));
    }
    Ok(media)
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

    const HOST: u8 = Medium::Host as u8;
    const DISK: u8 = Medium::Disk as u8;

    #[test]
    fn cpu_blocks_are_the_host_tier_even_before_a_replica_names_gpu() {
        // vLLM names the main cache GPU on every platform: CPU is always the host tier
        let mut ix = PrefixIndex::new(1).unwrap();
        ix.apply_batch_on(0, 0, &[S], &[0, 1], &[10], &[HOST])
            .unwrap();
        assert_eq!((ix.holders(10), ix.tier_holders(10)), (0, (1, 0)));
    }

    #[test]
    fn a_tiers_blocks_are_indexed_apart_from_the_devices() {
        let mut ix = PrefixIndex::new(2).unwrap();
        ix.apply_batch_on(0, 0, &[S, S], &[0, 1, 2], &[10, 11], &[0, HOST])
            .unwrap();
        ix.apply_batch_on(1, 0, &[S], &[0, 1], &[10], &[DISK])
            .unwrap();
        assert_eq!(ix.holders(10), 0b01);
        assert_eq!(ix.tier_holders(10), (0, 0b10));
        assert_eq!(ix.tier_holders(11), (0b01, 0));
        // a device removal leaves the tier's copy
        ix.apply_batch_on(0, 1, &[R], &[0, 1], &[11], &[0]).unwrap();
        assert_eq!(ix.tier_holders(11), (0b01, 0));
        ix.apply_batch_on(0, 2, &[R], &[0, 1], &[11], &[HOST])
            .unwrap();
        assert_eq!(
            (ix.tier_holders(11), ix.num_blocks_on(0, Medium::Host)),
            ((0, 0), 0)
        );
        // a clear forgets every medium of the replica
        ix.apply_batch_on(1, 1, &[C], &[0, 0], &[], &[0]).unwrap();
        assert_eq!((ix.tier_holders(10), ix.has_tier_blocks()), ((0, 0), false));
    }

    #[test]
    fn a_snapshot_with_media_replaces_every_medium() {
        let mut ix = PrefixIndex::new(1).unwrap();
        ix.apply_batch_on(0, 0, &[S], &[0, 1], &[5], &[HOST])
            .unwrap();
        ix.apply_snapshot_on(0, 9, &[1, 2], &[0, DISK]).unwrap();
        assert_eq!((ix.holders(1), ix.tier_holders(2)), (1, (0, 1)));
        assert_eq!(ix.tier_holders(5), (0, 0));
        assert!(ix.apply_snapshot_on(0, 9, &[1], &[7]).is_err());
        assert!(ix
            .apply_batch_on(0, 10, &[S], &[0, 1], &[1], &[0, 0])
            .is_err());
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
