//! KV events: the prefix cache's changes (blocks stored, removed, all cleared) recorded as they
//! happen, for a router that indexes every replica's cache (vLLM's `BlockStored` /
//! `BlockRemoved` / `AllBlocksCleared`).
//!
//! Recording is a few pushes onto flat vectors (no allocation once they have grown), and only
//! when a publisher asked for it (`set_enabled`); the engine drains the log once per step
//! (`drain`) into a [`KvEventBatch`]: the events in order, consecutive ones of the same kind
//! grouped into records the way vLLM batches them (one `BlockStored` per run of chained blocks,
//! one `BlockRemoved` per run of removals).
//!
//! Each log records one medium ([`Medium`]): the prefix cache's is the device cache, an offload
//! tier keeps one of its own (host memory, disk) so a router sees those hits too. The wire form
//! (vLLM's msgpack `KVEventBatch`), both ways, is [`wire`].
pub mod wire;

use super::prefix_cache::ROOT_HASH;
use crate::ids::TokenId;

/// Where the blocks of a record live (vLLM's `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Medium {
    /// The engine's KV cache (on the device the model runs on).
    #[default]
    Device = 0,
    /// The offload tier in host memory (vLLM's `CPU`).
    Host = 1,
    /// The offload tier on disk (vLLM's `STORAGE`).
    Disk = 2,
}

impl Medium {
    pub const ALL: [Medium; 3] = [Medium::Device, Medium::Host, Medium::Disk];

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    /// vLLM's name for the medium (the device cache's is `GPU`; a publisher may name it after
    /// its device instead, see `wire::EncodeOptions::device_medium`).
    pub fn vllm_name(self) -> &'static str {
        match self {
            Medium::Device => "GPU",
            Medium::Host => "CPU",
            Medium::Disk => "STORAGE",
        }
    }

    /// The medium a published name stands for: none or `GPU` the device cache, `CPU` host
    /// memory, anything else (`STORAGE`, a tier this code does not know) the slowest tier.
    pub fn from_vllm_name(name: Option<&str>) -> Self {
        match name {
            None | Some("GPU") => Medium::Device,
            Some("CPU") => Medium::Host,
            Some(_) => Medium::Disk,
        }
    }
}

/// What one record of a [`KvEventBatch`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum KvEventKind {
    /// Blocks registered in the prefix cache: a chain, each the parent of the next.
    Stored = 0,
    /// Blocks whose registration was dropped (evicted, or a failed step taken back).
    Removed = 1,
    /// Every registration dropped (a prefix-cache reset).
    AllCleared = 2,
}

/// The events of one step. Record `r` covers `hashes[starts[r]..starts[r + 1]]` (the block
/// hashes, in order); for a `Stored` record, `parents[r]` is the first block's parent
/// (`ROOT_HASH` for a sequence's first block), `extra_keys[r]` the hash key the blocks were
/// hashed under (the adapter's salt included), and the blocks' tokens are
/// `tokens[starts[r] * block_size..starts[r + 1] * block_size]`; `media[r]` is where they live
/// (a `Medium` code; an offload tier's stored blocks list no tokens: their slots hold 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvEventBatch {
    pub kinds: Vec<u8>,
    pub media: Vec<u8>,
    /// One more entry than `kinds`.
    pub starts: Vec<u32>,
    pub parents: Vec<u64>,
    pub extra_keys: Vec<u64>,
    pub hashes: Vec<u64>,
    /// `block_size` tokens per hash (none for removed blocks' hashes: their slots hold 0).
    pub tokens: Vec<TokenId>,
}

impl KvEventBatch {
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Appends `other`'s records after this batch's (a step's device and tier events).
    pub fn append(&mut self, mut other: KvEventBatch) {
        if other.is_empty() {
            return;
        }
        if self.starts.is_empty() {
            self.starts.push(0);
        }
        let base = self.hashes.len() as u32;
        self.starts
            .extend(other.starts.iter().skip(1).map(|&s| s + base));
        self.kinds.append(&mut other.kinds);
        self.media.append(&mut other.media);
        self.parents.append(&mut other.parents);
        self.extra_keys.append(&mut other.extra_keys);
        self.hashes.append(&mut other.hashes);
        self.tokens.append(&mut other.tokens);
    }
}

/// The log a prefix cache records its changes into (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct KvEventLog {
    enabled: bool,
    medium: Medium,
    block_size: usize,
    batch: KvEventBatch,
    /// Hash of the last stored block (chains a following stored block onto its record).
    last_stored: u64,
}

impl KvEventLog {
    /// A log of an offload tier's blocks (the prefix cache's is `default()`: the device's).
    pub fn for_medium(medium: Medium) -> Self {
        Self {
            medium,
            ..Self::default()
        }
    }

    pub fn medium(&self) -> Medium {
        self.medium
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Turns recording on or off (blocks of `block_size` tokens); turning it off drops what
    /// was recorded.
    pub fn set_enabled(&mut self, enabled: bool, block_size: usize) {
        self.enabled = enabled;
        self.block_size = block_size;
        if !enabled {
            self.batch = KvEventBatch::default();
        }
    }

    /// Starts a record of `kind` unless the last record can take the event.
    #[inline]
    fn open(&mut self, kind: KvEventKind, parent: u64, extra_key: u64) {
        let b = &mut self.batch;
        let continues = match b.kinds.last() {
            Some(&k) if k == kind as u8 => match kind {
                // a tier's blocks carry no chain (vLLM's offload events): one record per run
                KvEventKind::Stored if self.medium != Medium::Device => true,
                KvEventKind::Stored => {
                    parent == self.last_stored && b.extra_keys.last() == Some(&extra_key)
                }
                KvEventKind::Removed => true,
                KvEventKind::AllCleared => false,
            },
            _ => false,
        };
        if !continues {
            if b.starts.is_empty() {
                b.starts.push(0);
            }
            b.kinds.push(kind as u8);
            b.media.push(self.medium as u8);
            b.parents.push(parent);
            b.extra_keys.push(extra_key);
            b.starts.push(b.hashes.len() as u32);
        }
    }

    /// A block registered under `hash`, chained on `parent` (`ROOT_HASH` for a first block),
    /// holding `tokens` (one block's worth).
    #[inline]
    pub fn stored(&mut self, hash: u64, parent: u64, tokens: &[TokenId], extra_key: u64) {
        if !self.enabled {
            return;
        }
        self.open(KvEventKind::Stored, parent, extra_key);
        self.push_hash(hash);
        let b = &mut self.batch;
        let start = b.tokens.len();
        b.tokens.extend_from_slice(tokens);
        // A block is always `block_size` tokens; pad defensively so record offsets stay exact.
        b.tokens.resize(start + self.block_size, 0);
        self.last_stored = hash;
    }

    /// A tier's block stored under `hash` (no parent, no tokens: vLLM's offload events).
    pub fn stored_in_tier(&mut self, hash: u64) {
        self.stored(hash, ROOT_HASH, &[], 0);
    }

    /// A block registered under `hash` dropped its registration.
    #[inline]
    pub fn removed(&mut self, hash: u64) {
        if !self.enabled {
            return;
        }
        self.open(KvEventKind::Removed, ROOT_HASH, 0);
        self.push_hash(hash);
        let n = self.batch.tokens.len();
        self.batch.tokens.resize(n + self.block_size, 0);
    }

    /// Every registration dropped.
    pub fn all_cleared(&mut self) {
        if !self.enabled {
            return;
        }
        self.open(KvEventKind::AllCleared, ROOT_HASH, 0);
        let n = self.batch.hashes.len() as u32;
        *self.batch.starts.last_mut().expect("open pushed a start") = n;
    }

    #[inline]
    fn push_hash(&mut self, hash: u64) {
        let b = &mut self.batch;
        b.hashes.push(hash);
        *b.starts.last_mut().expect("open pushed a start") = b.hashes.len() as u32;
    }

    /// The events recorded since the last drain (the log starts empty again).
    pub fn drain(&mut self) -> KvEventBatch {
        std::mem::take(&mut self.batch)
    }

    /// Whether anything was recorded since the last drain.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::*;
    use crate::kv::prefix_cache::chain_hashes;

    fn kinds(b: &KvEventBatch) -> Vec<KvEventKind> {
        b.kinds
            .iter()
            .map(|&k| match k {
                0 => KvEventKind::Stored,
                1 => KvEventKind::Removed,
                _ => KvEventKind::AllCleared,
            })
            .collect()
    }

    #[test]
    fn nothing_is_recorded_until_enabled() {
        let mut m = manager(2, 8, 0);
        let p = toks(0..5);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 5, 0).unwrap();
        assert!(m.kv_events_mut().drain().is_empty());
    }

    #[test]
    fn a_prompts_blocks_are_one_stored_record_with_parent_and_tokens() {
        let mut m = manager(2, 8, 0);
        m.set_kv_events(true);
        let p = toks(10..15);
        m.allocate_prompt(1, &p, None, 7, false).unwrap();
        m.cache_full_blocks(1, &p, 5, 7).unwrap();
        let b = m.kv_events_mut().drain();
        assert_eq!(kinds(&b), vec![KvEventKind::Stored]);
        assert_eq!(b.starts, vec![0, 2]);
        assert_eq!(b.hashes, chain_hashes(&p, 2, 7));
        assert_eq!(b.parents, vec![ROOT_HASH]);
        assert_eq!(b.extra_keys, vec![7]);
        assert_eq!(b.tokens, toks(10..14));
        assert!(m.kv_events_mut().drain().is_empty(), "drained once");
    }

    #[test]
    fn a_decode_fill_chains_onto_its_parent_across_steps() {
        let mut m = manager(2, 8, 0);
        m.set_kv_events(true);
        let mut t = toks(0..3);
        alloc(&mut m, 1, &t);
        m.cache_full_blocks(1, &t, 3, 0).unwrap();
        let first = m.kv_events_mut().drain();
        t.push(3);
        m.append_slots(1, 3, 4).unwrap().unwrap();
        m.cache_full_blocks_batch(&[(1, &t, 4, 0)]).unwrap();
        let second = m.kv_events_mut().drain();
        assert_eq!(second.parents, vec![first.hashes[0]]);
        assert_eq!(second.hashes, vec![chain_hashes(&t, 2, 0)[1]]);
        assert_eq!(second.tokens, vec![2, 3]);
    }

    #[test]
    fn eviction_then_reset_are_recorded_in_order() {
        let mut m = manager(2, 2, 0);
        m.set_kv_events(true);
        let a = toks(0..3);
        alloc(&mut m, 1, &a);
        m.cache_full_blocks(1, &a, 3, 0).unwrap();
        m.free(1).unwrap();
        // A new prompt needs both blocks: the cached one is evicted.
        let b = toks(50..54);
        alloc(&mut m, 2, &b);
        m.cache_full_blocks(2, &b, 4, 0).unwrap();
        m.reset_prefix_cache();
        let ev = m.kv_events_mut().drain();
        assert_eq!(
            kinds(&ev),
            vec![
                KvEventKind::Stored,
                KvEventKind::Removed,
                KvEventKind::Stored,
                KvEventKind::AllCleared
            ]
        );
        let h_a = chain_hashes(&a, 2, 0)[0];
        assert_eq!(ev.hashes[..2], [h_a, h_a]);
        assert_eq!(ev.starts, vec![0, 1, 2, 4, 4]);
    }

    #[test]
    fn a_rolled_back_step_removes_what_it_stored() {
        let mut m = manager(2, 8, 0);
        m.set_kv_events(true);
        m.begin_step();
        let p = toks(0..5);
        alloc(&mut m, 1, &p);
        m.cache_full_blocks(1, &p, 5, 0).unwrap();
        m.free(1).unwrap();
        assert_eq!(m.forget_step_registrations().unwrap(), 2);
        let ev = m.kv_events_mut().drain();
        assert_eq!(kinds(&ev), vec![KvEventKind::Stored, KvEventKind::Removed]);
        let mut removed = ev.hashes[2..].to_vec();
        removed.sort_unstable();
        let mut stored = ev.hashes[..2].to_vec();
        stored.sort_unstable();
        assert_eq!(removed, stored);
    }

    #[test]
    fn registered_hashes_are_the_stored_minus_the_removed() {
        let mut m = manager(2, 3, 0);
        m.set_kv_events(true);
        let mut live = std::collections::HashSet::new();
        for (seq, start) in [(1, 0u32), (2, 100), (3, 200)] {
            let p = toks(start..start + 5);
            alloc(&mut m, seq, &p);
            m.cache_full_blocks(seq, &p, 5, 0).unwrap();
            m.free(seq).unwrap();
            let ev = m.kv_events_mut().drain();
            for r in 0..ev.len() {
                let hs = &ev.hashes[ev.starts[r] as usize..ev.starts[r + 1] as usize];
                for &h in hs {
                    if ev.kinds[r] == KvEventKind::Stored as u8 {
                        live.insert(h);
                    } else {
                        live.remove(&h);
                    }
                }
            }
        }
        let mut registered = m.registered_hashes();
        registered.sort_unstable();
        let mut expected: Vec<u64> = live.into_iter().collect();
        expected.sort_unstable();
        assert_eq!(registered, expected);
    }
}
