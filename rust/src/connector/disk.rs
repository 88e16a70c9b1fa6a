//! The disk tier's scheduler side (`kv_offloading_backend="disk"`): one file per block in a
//! directory, named by the block's chained hash ([`block_file_name`]), so that the tier
//! outlives the engine and several engines on one machine (data-parallel replicas) share it:
//! a block one of them saved is a hit for every other.
//!
//! The directory is the index: a block matches when its file exists (the workers write a
//! file under a temporary name and rename it, so a visible file is complete). The workers
//! check each file's header (the model's fingerprint, dtype, block size, layout), its size and
//! its payload's checksum before loading it and report a mismatched, truncated or corrupted
//! one as a failed load; this side then never offers that hash again. Capacity (LRU by modification time) is the workers' business: they touch a file
//! when they load it and delete the oldest when a save would exceed the size.
//!
//! KV events (medium `STORAGE`): a block is published stored once its save is reported and
//! its file is there, and removed when its file is gone: the workers report the files they
//! evicted to stay within the size (`tier_removed`, with the saves that made room), a failed
//! load reports its block, and a block looked up and missing (another engine evicted it) is
//! published removed at once. So a router's disk index keeps no stale blocks, and no step lists
//! the directory (whose size grows with the files).
use std::collections::HashSet;
use std::path::PathBuf;

use super::{ConnectorMeta, ConnectorOutput, ConnectorRequest, KvConnector, OffloadStats};
use crate::ids::BlockId;
use crate::kv::events::Medium;
use crate::kv::prefix_cache::PrefixCache;
use crate::kv::KvEventLog;

/// The file of block `hash` inside the tier's directory (the workers name files by this too).
pub fn block_file_name(hash: u64) -> String {
    format!("{hash:016x}.kvblock")
}

#[derive(Debug)]
pub struct DiskConnector {
    block_size: usize,
    dir: PathBuf,
    /// Hashes whose file failed to load here (mismatched, truncated, gone): not offered again.
    bad: HashSet<u64>,
    /// Hashes this engine is saving (not visible until renamed): not saved twice.
    saving: HashSet<u64>,
    /// Transfer -> (device block, hash) of each block it moves.
    jobs: std::collections::HashMap<u64, Vec<(BlockId, u64)>>,
    pending: ConnectorMeta,
    stats: OffloadStats,
    /// Blocks this engine saved (stored) or found gone or unloadable (removed), on the disk
    /// medium.
    events: KvEventLog,
    /// Hashes published stored and not removed since (only while events are on).
    published: HashSet<u64>,
}

impl DiskConnector {
    pub fn new(block_size: usize, dir: impl Into<PathBuf>) -> Self {
        DiskConnector {
            block_size,
            dir: dir.into(),
            bad: HashSet::new(),
            saving: HashSet::new(),
            jobs: Default::default(),
            pending: ConnectorMeta::default(),
            stats: OffloadStats::default(),
            events: KvEventLog::for_medium(Medium::Disk),
            published: HashSet::new(),
        }
    }

    fn on_disk(&self, hash: u64) -> bool {
        !self.bad.contains(&hash) && self.dir.join(block_file_name(hash)).is_file()
    }

    /// `hash` published removed, if it was published stored.
    fn unpublish(&mut self, hash: u64) {
        if self.published.remove(&hash) {
            self.events.removed(hash);
        }
    }
}

impl KvConnector for DiskConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &ConnectorRequest<'_>,
        num_computed: usize,
    ) -> (usize, bool) {
        let bs = self.block_size;
        let eligible =
            PrefixCache::eligible_blocks(req.tokens.len(), bs).min(req.block_hashes.len());
        let start = (num_computed / bs).min(eligible);
        let hits = req.block_hashes[start..eligible]
            .iter()
            .take_while(|&&h| self.on_disk(h))
            .count();
        if let Some(&missing) = req.block_hashes[start..eligible].get(hits) {
            self.unpublish(missing); // evicted (here or by another engine) since it was stored
        }
        if hits == 0 {
            self.stats.missed_blocks += (eligible - start) as u64;
        }
        (hits * bs, true)
    }

    fn update_state_after_alloc(
        &mut self,
        req: &ConnectorRequest<'_>,
        blocks: &[BlockId],
        num_external_tokens: usize,
    ) {
        let n = num_external_tokens / self.block_size;
        let first = blocks.len() - n;
        let mut moved = Vec::with_capacity(n);
        for (i, &block) in blocks.iter().enumerate().skip(first) {
            let hash = req.block_hashes[i];
            self.pending.push_load(req.job, block, 0, hash);
            moved.push((block, hash));
        }
        self.stats.hit_blocks += n as u64;
        self.jobs.insert(req.job, moved);
    }

    fn build_connector_meta(&mut self, meta: &mut ConnectorMeta) {
        self.pending.drain_into(meta);
    }

    fn request_finished(&mut self, req: &ConnectorRequest<'_>, blocks: &[BlockId]) -> bool {
        let mut moved = Vec::new();
        for (&block, &hash) in blocks.iter().zip(req.block_hashes) {
            if self.saving.contains(&hash) || self.on_disk(hash) {
                continue;
            }
            self.bad.remove(&hash); // a fresh save replaces a bad file
            self.saving.insert(hash);
            self.pending.push_save(req.job, block, 0, hash);
            moved.push((block, hash));
        }
        if moved.is_empty() {
            return false;
        }
        self.stats.saved_blocks += moved.len() as u64;
        self.jobs.insert(req.job, moved);
        true
    }

    fn tier_removed(&mut self, hashes: &[u64]) {
        let mut gone = hashes.to_vec();
        gone.sort_unstable(); // one order for a run's events
        for hash in gone {
            self.unpublish(hash);
        }
    }

    fn update_connector_output(&mut self, out: &ConnectorOutput<'_>) {
        for job in out.finished_sending {
            for (_, hash) in self.jobs.remove(job).unwrap_or_default() {
                self.saving.remove(&hash);
                if self.on_disk(hash) && self.events.is_enabled() && self.published.insert(hash) {
                    self.events.stored_in_tier(hash);
                }
            }
        }
        for job in out.finished_recving {
            for (block, hash) in self.jobs.remove(job).unwrap_or_default() {
                if out.invalid_blocks.contains(&block) {
                    self.stats.failed_blocks += 1;
                    self.bad.insert(hash);
                    self.unpublish(hash);
                } else {
                    self.stats.loaded_blocks += 1;
                }
            }
        }
    }

    fn offload_stats(&self) -> Option<OffloadStats> {
        Some(self.stats)
    }

    fn kv_events_mut(&mut self) -> Option<&mut KvEventLog> {
        Some(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_matches_while_its_file_exists_and_never_after_a_failed_load() {
        let dir = std::env::temp_dir().join(format!("pagedllm-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = DiskConnector::new(2, &dir);
        let tokens = [1; 7];
        let hashes = [10, 11, 12];
        let r = |job| ConnectorRequest {
            id: "r",
            job,
            tokens: &tokens,
            block_hashes: &hashes,
        };
        assert_eq!(c.get_num_new_matched_tokens(&r(0), 0), (0, true));
        // Saving: not offered until the file is there, never saved twice meanwhile.
        assert!(c.request_finished(&r(1), &[4, 5, 6]));
        assert!(!c.request_finished(&r(2), &[4, 5, 6]));
        for h in [10, 11] {
            std::fs::write(dir.join(block_file_name(h)), b"x").unwrap();
        }
        c.update_connector_output(&ConnectorOutput {
            finished_sending: &[1],
            ..Default::default()
        });
        assert_eq!(c.get_num_new_matched_tokens(&r(0), 0), (4, true));
        c.update_state_after_alloc(&r(3), &[7, 8], 4);
        c.update_connector_output(&ConnectorOutput {
            finished_recving: &[3],
            invalid_blocks: &[8],
            ..Default::default()
        });
        assert_eq!(c.get_num_new_matched_tokens(&r(0), 0), (2, true));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stored_block_whose_file_is_evicted_is_published_removed_on_storage() {
        let dir = std::env::temp_dir().join(format!("pagedllm-disk-ev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = DiskConnector::new(2, &dir);
        c.kv_events_mut().unwrap().set_enabled(true, 2);
        let tokens = [1; 5];
        let (first, second) = ([10, 11], [20, 21]);
        let r = |job, hashes: &'static [u64]| ConnectorRequest {
            id: "r",
            job,
            tokens: &tokens,
            block_hashes: hashes,
        };
        let save = |c: &mut DiskConnector, job, hashes: &'static [u64]| {
            assert!(c.request_finished(&r(job, hashes), &[4, 5]));
            for &h in hashes {
                std::fs::write(dir.join(block_file_name(h)), b"x").unwrap();
            }
            c.update_connector_output(&ConnectorOutput {
                finished_sending: &[job],
                ..Default::default()
            });
            c.kv_events_mut().unwrap().drain()
        };
        let stored = save(&mut c, 1, &[10, 11]);
        assert_eq!((stored.kinds, stored.hashes), (vec![0], first.to_vec()));
        // the workers evict block 10 to make room for the next save, and report it with it
        std::fs::remove_file(dir.join(block_file_name(10))).unwrap();
        c.tier_removed(&[10]);
        let b = save(&mut c, 2, &[20, 21]);
        assert_eq!(b.kinds, vec![1, 0]);
        assert_eq!(b.media, vec![Medium::Disk as u8; 2]);
        assert_eq!(b.hashes, vec![10, second[0], second[1]]);
        // one another engine evicted is published removed when looked up
        std::fs::remove_file(dir.join(block_file_name(11))).unwrap();
        c.get_num_new_matched_tokens(&r(3, &[11, 20]), 0);
        let b = c.kv_events_mut().unwrap().drain();
        assert_eq!((b.kinds, b.hashes), (vec![1], vec![11]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_save_step_publishes_only_the_reported_evictions_without_listing_the_directory() {
        let dir = std::env::temp_dir().join(format!("pagedllm-disk-nl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = DiskConnector::new(2, &dir);
        c.kv_events_mut().unwrap().set_enabled(true, 2);
        let tokens = [1; 5];
        for (job, hashes) in [(1, &[10, 11]), (2, &[20, 21])] {
            let req = ConnectorRequest {
                id: "r",
                job,
                tokens: &tokens,
                block_hashes: hashes,
            };
            assert!(c.request_finished(&req, &[4, 5]));
            for &h in hashes {
                std::fs::write(dir.join(block_file_name(h)), b"x").unwrap();
            }
            if job == 2 {
                // gone without a report (another engine's eviction): not looked for here
                std::fs::remove_file(dir.join(block_file_name(10))).unwrap();
                c.tier_removed(&[11]);
            }
            c.update_connector_output(&ConnectorOutput {
                finished_sending: &[job],
                ..Default::default()
            });
        }
        let b = c.kv_events_mut().unwrap().drain();
        assert_eq!(b.kinds, vec![0, 1, 0]);
        assert_eq!(b.hashes, vec![10, 11, 11, 20, 21]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
