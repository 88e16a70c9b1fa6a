//! Another engine's KV events (a vLLM server's) in this router's block hashes.
//!
//! A vLLM replica names its blocks by its own hash function (SHA-256 by default, published as
//! its low 64 bits), which the router cannot compute for a prompt. Its `BlockStored` events
//! carry what the hash was made from, though: the parent block's hash and the blocks' token
//! ids. So each stored block is re-hashed with pagedllm's chained hash, continuing from the
//! parent's re-hash, and [`ForeignTable`] remembers foreign hash -> own hash (and the media
//! holding the block) until no medium does; the index then holds own hashes only, the same ones
//! `Router::route` computes from a prompt. An offload tier's stored event lists no tokens
//! (vLLM's offloading connector's): its blocks are translated through the table, from the
//! device event that stored them first.
//!
//! Left out (never matched, so never routed to by mistake): blocks whose parent was not seen
//! (stored before the router subscribed, or in a lost batch), blocks of another block size,
//! and blocks whose hash covers more than the tokens (a LoRA adapter, images, a cache salt),
//! which a prompt's hash here would not include.
use std::collections::HashMap;

use crate::kv::events::wire::{DecodedBatch, IndexRecords};
use crate::kv::prefix_cache::{chain_hashes_from, ROOT_HASH};
use crate::kv::KvEventKind;

/// A foreign block's own hash and the media holding it (one bit per `Medium` code).
type Entry = (u64, u8);

/// One replica's foreign hash -> own hash table (its size is that replica's cached blocks).
///
/// A batch's changes are staged and kept only if the index applied the batch (`commit`), so
/// a batch refused as a gap and replayed later is translated again from the same table.
#[derive(Debug, Clone, Default)]
pub struct ForeignTable {
    block_size: usize,
    own: HashMap<u64, Entry>,
    /// None: gone in this batch.
    staged: HashMap<u64, Option<Entry>>,
    cleared: bool,
}

impl ForeignTable {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            ..Self::default()
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The kept table: foreign hash -> own hash.
    pub fn own(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.own.iter().map(|(&k, &(mine, _))| (k, mine))
    }

    /// `d`'s records in own hashes (the blocks that cannot be had left out), its changes to
    /// the table staged (`commit` or `rollback` next).
    pub fn translate(&mut self, d: &DecodedBatch) -> IndexRecords {
        let mut out = IndexRecords::new();
        for r in 0..d.len() {
            let (kind, medium) = (d.kinds[r], d.media[r]);
            let bit = 1u8 << medium;
            let (keys, _) = d.record_hashes(r);
            match kind {
                k if k == KvEventKind::Stored as u8 => {
                    let tokens = d.record_tokens(r);
                    let own = if tokens.is_empty() {
                        self.known(keys)
                    } else {
                        self.rehash(d, r, keys, tokens)
                    };
                    for (key, mine) in own {
                        let bits = self.get(key).map_or(0, |e| e.1);
                        self.staged.insert(key, Some((mine, bits | bit)));
                        out.hashes.push(mine);
                    }
                }
                k if k == KvEventKind::Removed as u8 => {
                    for &key in keys {
                        if let Some((mine, bits)) = self.get(key) {
                            let left = bits & !bit;
                            self.staged.insert(key, (left != 0).then_some((mine, left)));
                            out.hashes.push(mine);
                        }
                    }
                }
                _ => {
                    self.staged.clear();
                    self.cleared = true;
                }
            }
            out.close(kind, medium);
        }
        out
    }

    /// Stored blocks re-hashed from their tokens, continuing their parent's own chain; none
    /// when that cannot be done (see the module docs).
    fn rehash(&self, d: &DecodedBatch, r: usize, keys: &[u64], tokens: &[u32]) -> Vec<(u64, u64)> {
        let bs = self.block_size;
        if d.block_sizes[r] != Some(bs as u32) || d.lora_ids[r].is_some() || !d.plain[r] {
            return Vec::new();
        }
        if keys.is_empty() || tokens.len() != keys.len() * bs {
            return Vec::new();
        }
        let parent = match d.parents[r] {
            None => ROOT_HASH,
            Some(p) => match self.get(p) {
                Some((mine, _)) => mine,
                None => return Vec::new(),
            },
        };
        let own = chain_hashes_from(parent, tokens, bs, 0);
        keys.iter().copied().zip(own).collect()
    }

    /// A tier's stored blocks (no tokens): those the table knows.
    fn known(&self, keys: &[u64]) -> Vec<(u64, u64)> {
        keys.iter()
            .filter_map(|&k| self.get(k).map(|(mine, _)| (k, mine)))
            .collect()
    }

    /// Forgets every block at once, staged or kept (the replica starts over).
    pub fn reset(&mut self) {
        self.own.clear();
        self.rollback();
    }

    /// Keeps the staged batch's changes (the index applied it).
    pub fn commit(&mut self) {
        if self.cleared {
            self.own.clear();
        }
        for (key, entry) in self.staged.drain() {
            match entry {
                Some(e) => self.own.insert(key, e),
                None => self.own.remove(&key),
            };
        }
        self.cleared = false;
    }

    /// Drops the staged batch's changes (the index did not apply it).
    pub fn rollback(&mut self) {
        self.staged.clear();
        self.cleared = false;
    }

    fn get(&self, key: u64) -> Option<Entry> {
        match self.staged.get(&key) {
            Some(staged) => *staged,
            None if self.cleared => None,
            None => self.own.get(&key).copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::events::wire::{encode, EncodeOptions, Records};
    use crate::kv::events::{KvEventLog, Medium};
    use crate::kv::prefix_cache::chain_hashes;

    const BS: usize = 2;

    fn decoded(log: &mut KvEventLog, medium: Option<&str>) -> DecodedBatch {
        let b = log.drain();
        let o = EncodeOptions {
            block_size: BS,
            device_medium: medium,
            ..EncodeOptions::default()
        };
        crate::kv::events::wire::decode(&encode(0.0, &Records::of(&b), &o).unwrap()).unwrap()
    }

    #[test]
    fn a_device_chain_then_its_host_copy_translate_to_own_hashes() {
        let tokens = [1, 2, 3, 4];
        let mut device = KvEventLog::default();
        device.set_enabled(true, BS);
        device.stored(901, ROOT_HASH, &tokens[..2], 0);
        device.stored(902, 901, &tokens[2..], 0);
        let mut t = ForeignTable::new(BS);
        let own = t.translate(&decoded(&mut device, Some("GPU")));
        t.commit();
        assert_eq!(own.hashes, chain_hashes(&tokens, BS, 0));
        let mut host = KvEventLog::for_medium(Medium::Host);
        host.set_enabled(true, BS);
        host.stored_in_tier(902);
        let copied = t.translate(&decoded(&mut host, None));
        t.commit();
        assert_eq!(copied.hashes, own.hashes[1..]);
        assert_eq!(copied.media, vec![Medium::Host as u8]);
        // the device drops it; the host copy keeps the translation alive
        device.removed(902);
        t.translate(&decoded(&mut device, Some("GPU")));
        t.commit();
        host.removed(902);
        let removed = t.translate(&decoded(&mut host, None));
        t.commit();
        assert_eq!(removed.hashes, own.hashes[1..]);
        assert_eq!(t.own().count(), 1);
    }

    #[test]
    fn a_rolled_back_batch_leaves_the_table_as_it_was() {
        let mut device = KvEventLog::default();
        device.set_enabled(true, BS);
        device.stored(901, ROOT_HASH, &[1, 2], 0);
        let mut t = ForeignTable::new(BS);
        t.translate(&decoded(&mut device, None));
        t.commit();
        device.all_cleared();
        t.translate(&decoded(&mut device, None));
        t.rollback();
        assert_eq!(t.own().count(), 1);
    }
}
