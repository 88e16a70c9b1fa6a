//! Prefix cache: chained block hashes and the hash -> device block map.
//!
//! A full block's hash mixes its parent block's hash, its token ids and an extra key (e.g. an
//! adapter id), so equal hashes mean equal whole prefixes, not just equal blocks. The hash is a
//! wyhash-style multiply-fold over two tokens per 64-bit word: a 16-token block costs a handful of
//! 128-bit multiplies (~10 ns), far below a pure-Python hash (~1 µs).
use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashTable;

use super::events::KvEventLog;
use crate::ids::{BlockId, TokenId};

/// Prefix-map entries reserved up front (at most the pool size).
const PRESIZED_ENTRIES: usize = 1 << 15;

/// `block_hash` of a block that is not registered. A block whose hash happens to equal it
/// (odds 2^-64) is simply never shared.
const NO_HASH: u64 = u64::MAX;

/// Parent hash of a sequence's first block.
pub const ROOT_HASH: u64 = 0x2d35_8dcc_aa6c_78a5;

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
const P3: u64 = 0x5899_65cc_7537_4cc3;

/// 64x64 -> 128-bit multiply folded back to 64 bits: the mixing step.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Packs two tokens into one 64-bit word.
#[inline(always)]
fn word(lo: TokenId, hi: TokenId) -> u64 {
    lo as u64 | (hi as u64) << 32
}

/// Chained hash of one block: `parent` is the previous block's hash (`ROOT_HASH` for the first).
#[inline]
pub fn hash_block(parent: u64, tokens: &[TokenId], extra_key: u64) -> u64 {
    let seed = fold_mul(parent ^ P0, extra_key ^ P1);
    // Two independent lanes of 4 tokens each: their multiplies overlap in the pipeline, so a
    // block costs about half the latency of a single serial chain.
    let (mut s0, mut s1) = (seed, seed ^ P3);
    let mut chunks = tokens.chunks_exact(8);
    for c in &mut chunks {
        s0 = fold_mul(word(c[0], c[1]) ^ P1 ^ s0, word(c[2], c[3]) ^ P2);
        s1 = fold_mul(word(c[4], c[5]) ^ P3 ^ s1, word(c[6], c[7]) ^ P0);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut words = [0u64; 4];
        for (i, &t) in rest.iter().enumerate() {
            words[i / 2] |= (t as u64) << (32 * (i % 2));
        }
        s0 = fold_mul(words[0] ^ P1 ^ s0, words[1] ^ P2);
        s1 = fold_mul(words[2] ^ P3 ^ s1, words[3] ^ P0);
    }
    // The length goes in last so that trailing zero tokens still change the hash.
    fold_mul(s0 ^ P3 ^ tokens.len() as u64, s1 ^ P1)
}

/// `extra_key` salted with `salt` (e.g. a LoRA adapter id; 0 = no salt): blocks hashed under
/// different salts never match, so the same tokens under two adapters share no block.
#[inline]
pub fn salted_key(extra_key: u64, salt: u64) -> u64 {
    if salt == 0 {
        return extra_key;
    }
    fold_mul(extra_key ^ P2, salt ^ P3) ^ salt
}

/// Chain hashes of every full block of `tokens`.
pub fn chain_hashes(tokens: &[TokenId], block_size: usize, extra_key: u64) -> Vec<u64> {
    chain_hashes_from(ROOT_HASH, tokens, block_size, extra_key)
}

/// Chain hashes of every full block of `tokens` continuing the chain whose last block hashed to
/// `parent` (`ROOT_HASH`: a sequence's first block). A router re-hashes another engine's stored
/// blocks with it, from the parent it already knows and the tokens the event carries.
pub fn chain_hashes_from(
    parent: u64,
    tokens: &[TokenId],
    block_size: usize,
    extra_key: u64,
) -> Vec<u64> {
    chain(parent, tokens, block_size, extra_key).collect()
}

/// Extends `hashes` (the chain of the first `hashes.len()` blocks of `tokens`) up to `num_blocks`.
/// The caller guarantees `num_blocks * block_size <= tokens.len()`.
pub(crate) fn extend_chain(
    hashes: &mut Vec<u64>,
    tokens: &[TokenId],
    block_size: usize,
    extra_key: u64,
    num_blocks: usize,
) {
    let done = hashes.len();
    if num_blocks <= done {
        return;
    }
    let parent = hashes.last().copied().unwrap_or(ROOT_HASH);
    let rest = &tokens[done * block_size..num_blocks * block_size];
    hashes.extend(chain(parent, rest, block_size, extra_key));
}

/// The hashes of `tokens`' full blocks, each chained to the one before, the first to `parent`.
fn chain(
    parent: u64,
    tokens: &[TokenId],
    block_size: usize,
    extra_key: u64,
) -> impl Iterator<Item = u64> + '_ {
    tokens
        .chunks_exact(block_size.max(1))
        .scan(parent, move |parent, block| {
            *parent = hash_block(*parent, block, extra_key);
            Some(*parent)
        })
}

/// Hasher for keys that are already well-mixed 64-bit values (block hashes) or small ids
/// (sequence ids, block ids): a single multiply instead of SipHash.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(P0);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        // Fibonacci multiply spreads small consecutive ids over the high bits hashbrown uses.
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    #[inline]
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

pub type IdBuildHasher = BuildHasherDefault<IdHasher>;

/// Result of a prefix lookup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens covered by `blocks` (= `blocks.len() * block_size`).
    pub num_cached_tokens: usize,
    /// Device blocks of the longest run of leading cached full blocks (a hybrid manager's
    /// group 0; `NULL_BLOCK` where its window does not reach).
    pub blocks: Vec<BlockId>,
    /// A hybrid manager's groups 1.., rows as long as `blocks` (empty otherwise).
    pub others: Vec<Vec<BlockId>>,
    /// Chain hashes of every full block of the looked-up tokens (empty when caching is off).
    pub hashes: Vec<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Counted lookups.
    pub queries: u64,
    /// Full blocks eligible for reuse over all counted lookups (hits + misses).
    pub query_blocks: u64,
    /// Eligible blocks found in the cache.
    pub hits: u64,
    /// Eligible blocks not found.
    pub misses: u64,
    /// Cached blocks whose contents were dropped to make room.
    pub evictions: u64,
}

impl PrefixCacheStats {
    pub fn hit_rate(&self) -> f64 {
        if self.query_blocks == 0 {
            0.0
        } else {
            self.hits as f64 / self.query_blocks as f64
        }
    }
}

#[derive(Debug, Clone)]
pub struct PrefixCache {
    enabled: bool,
    /// Registered device blocks, found by hash. An entry is only the block id (its hash is
    /// `block_hash[id]`): 4 bytes instead of a 16-byte (hash, id) pair, so the table of a
    /// 32K-block pool is 256 KiB rather than 1 MiB and a decode step's inserts mostly land on
    /// lines still in L2 (they were most of what prefix caching adds to a step).
    map: HashTable<BlockId>,
    /// Each device block's registered hash, `NO_HASH` when none.
    block_hash: Vec<u64>,
    stats: PrefixCacheStats,
    /// Blocks registered since `start_journal`: a step whose computation failed takes
    /// them back (their KV was never written). `None` until a scheduler starts one, so a
    /// manager used without steps keeps no list that only grows.
    journal: Option<Vec<BlockId>>,
    /// KV events (off unless a publisher turns them on; see `events.rs`).
    events: KvEventLog,
}

impl PrefixCache {
    pub fn new(num_device_blocks: usize, enabled: bool) -> Self {
        Self {
            events: KvEventLog::default(),
            enabled,
            // Registrations up to 32K blocks never rehash (growth rehashes were ~7% of an
            // admission burst); larger pools grow past that on demand, which keeps a big but
            // lightly used map compact.
            map: HashTable::with_capacity(if enabled {
                num_device_blocks.min(PRESIZED_ENTRIES)
            } else {
                0
            }),
            block_hash: vec![NO_HASH; num_device_blocks],
            stats: PrefixCacheStats::default(),
            journal: None,
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    pub fn get(&self, hash: u64) -> Option<BlockId> {
        // Block hashes are already well mixed: they index the table as they are.
        let hashes = &self.block_hash;
        self.map
            .find(hash, |&b| hashes[b as usize] == hash)
            .copied()
    }

    /// The hash a device block is registered under, if any.
    pub fn block_hash(&self, block: BlockId) -> Option<u64> {
        self.block_hash
            .get(block as usize)
            .copied()
            .filter(|&h| h != NO_HASH)
    }

    pub fn is_registered(&self, block: BlockId) -> bool {
        self.block_hash(block).is_some()
    }

    /// Hints the processor to fetch `block`'s hash entry (read by `register`) ahead of time.
    #[inline]
    pub(crate) fn prefetch_block(&self, block: BlockId) {
        #[cfg(target_arch = "x86_64")]
        if let Some(entry) = self.block_hash.get(block as usize) {
            // SAFETY: a prefetch is only a hint; it never faults and the pointer is valid.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    entry as *const u64 as *const i8,
                )
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = block;
    }

    /// Registers `block` under `hash`. Returns false (and changes nothing) when the hash is
    /// already mapped (to this or another block) or the block already has a hash.
    pub fn register(&mut self, block: BlockId, hash: u64) -> bool {
        if !self.enabled || self.is_registered(block) || hash == NO_HASH {
            return false;
        }
        let hashes = &self.block_hash;
        let entry = self.map.entry(
            hash,
            |&b| hashes[b as usize] == hash,
            |&b| hashes[b as usize],
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(_) => false,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(block);
                self.block_hash[block as usize] = hash;
                if let Some(journal) = &mut self.journal {
                    journal.push(block);
                }
                true
            }
        }
    }

    /// `register`, recording a stored event: `hash` chains on `parent` over `tokens`.
    #[inline]
    pub fn register_chained(
        &mut self,
        block: BlockId,
        hash: u64,
        parent: u64,
        tokens: &[TokenId],
        extra_key: u64,
    ) -> bool {
        let registered = self.register(block, hash);
        if registered {
            self.events.stored(hash, parent, tokens, extra_key);
        }
        registered
    }

    pub fn events_mut(&mut self) -> &mut KvEventLog {
        &mut self.events
    }

    /// Every registered hash (a snapshot of the cache's contents, in no order).
    pub fn registered_hashes(&self) -> Vec<u64> {
        self.map
            .iter()
            .map(|&b| self.block_hash[b as usize])
            .collect()
    }

    /// Drops the registration of a block being reused for other contents.
    pub fn evict(&mut self, block: BlockId) {
        if self.unregister(block) {
            self.stats.evictions += 1;
        }
    }

    /// Starts a new journal of registrations (see `take_journal`).
    pub fn start_journal(&mut self) {
        self.journal.get_or_insert_with(Vec::new).clear();
    }

    /// Blocks registered since `start_journal` (some may have been evicted since); empty
    /// when no journal was started.
    pub fn take_journal(&mut self) -> Vec<BlockId> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether `block` was registered since `start_journal`.
    pub fn in_journal(&self, block: BlockId) -> bool {
        self.journal.as_ref().is_some_and(|j| j.contains(&block))
    }

    /// Drops a block's registration without counting an eviction (its contents turned out
    /// not to be what the hash says). Returns whether it was registered.
    pub fn unregister(&mut self, block: BlockId) -> bool {
        let hash = std::mem::replace(&mut self.block_hash[block as usize], NO_HASH);
        if hash == NO_HASH {
            return false;
        }
        // Found by id: the entry's own hash is not even read.
        if let Ok(entry) = self.map.find_entry(hash, |&b| b == block) {
            entry.remove();
        }
        self.events.removed(hash);
        true
    }

    /// Drops every registration (counters are kept).
    pub fn clear(&mut self) {
        self.events.all_cleared();
        self.map.clear();
        self.block_hash.fill(NO_HASH);
    }

    /// Read-only lookup: longest run of leading cached full blocks within `tokens[..len-1]`
    /// (the last token is always computed so that it yields logits).
    pub fn find(&self, tokens: &[TokenId], block_size: usize, extra_key: u64) -> PrefixHit {
        if !self.enabled || block_size == 0 {
            return PrefixHit::default();
        }
        // Room for the blocks a decode adds later: the chain moves into the sequence's table.
        let n = tokens.len() / block_size;
        let mut hashes = Vec::with_capacity(n + n / 2 + 2);
        extend_chain(&mut hashes, tokens, block_size, extra_key, n);
        let eligible = Self::eligible_blocks(tokens.len(), block_size);
        let blocks: Vec<BlockId> = hashes[..eligible]
            .iter()
            .map_while(|&h| self.get(h))
            .collect();
        PrefixHit {
            num_cached_tokens: blocks.len() * block_size,
            blocks,
            others: Vec::new(),
            hashes,
        }
    }

    /// Full blocks that may be reused for a prompt of `num_tokens` tokens.
    pub fn eligible_blocks(num_tokens: usize, block_size: usize) -> usize {
        num_tokens.saturating_sub(1) / block_size
    }

    /// Counts one lookup of a prompt of `num_tokens` tokens that found `hit_blocks` blocks.
    pub fn record(&mut self, num_tokens: usize, block_size: usize, hit_blocks: usize) {
        if !self.enabled {
            return;
        }
        let eligible = Self::eligible_blocks(num_tokens, block_size) as u64;
        self.stats.queries += 1;
        self.stats.query_blocks += eligible;
        self.stats.hits += hit_blocks as u64;
        self.stats.misses += eligible - hit_blocks as u64;
    }

    /// The map and the per-block hashes agree both ways.
    pub fn check(&self) -> std::result::Result<(), String> {
        for &block in &self.map {
            let Some(hash) = self.block_hash(block) else {
                return Err(format!(
                    "prefix cache maps block {block}, which has no hash"
                ));
            };
            if self.get(hash) != Some(block) {
                return Err(format!(
                    "block {block} carries hash {hash:#x}, which the prefix cache maps to {:?}",
                    self.get(hash)
                ));
            }
        }
        let registered = self.block_hash.iter().filter(|&&h| h != NO_HASH).count();
        if registered != self.map.len() {
            return Err(format!(
                "{registered} blocks carry a hash but the prefix cache maps {}",
                self.map.len()
            ));
        }
        if !self.enabled && registered != 0 {
            return Err("prefix caching is off but blocks are registered".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_are_journaled_only_once_a_journal_is_started() {
        let mut cache = PrefixCache::new(8, true);
        for block in 0..4 {
            assert!(cache.register(block, 100 + block as u64));
        }
        assert!(cache.journal.is_none(), "no step: nothing kept");
        cache.start_journal();
        assert!(cache.register(4, 104));
        assert_eq!(cache.take_journal(), vec![4]);
        cache.start_journal();
        assert!(cache.take_journal().is_empty());
    }

    #[test]
    fn hash_is_deterministic_and_chained() {
        let t: Vec<TokenId> = (0..16).collect();
        assert_eq!(hash_block(ROOT_HASH, &t, 0), hash_block(ROOT_HASH, &t, 0));
        assert_ne!(
            hash_block(ROOT_HASH, &t, 0),
            hash_block(ROOT_HASH ^ 1, &t, 0)
        );
        assert_ne!(hash_block(ROOT_HASH, &t, 0), hash_block(ROOT_HASH, &t, 1));
    }

    #[test]
    fn hash_depends_on_every_token_and_position() {
        let base: Vec<TokenId> = (100..116).collect();
        let h = hash_block(ROOT_HASH, &base, 0);
        for i in 0..base.len() {
            let mut t = base.clone();
            t[i] ^= 1;
            assert_ne!(hash_block(ROOT_HASH, &t, 0), h, "token {i}");
        }
        let mut swapped = base.clone();
        swapped.swap(0, 1);
        assert_ne!(hash_block(ROOT_HASH, &swapped, 0), h);
    }

    #[test]
    fn hash_covers_odd_lengths_and_trailing_zeros() {
        assert_ne!(
            hash_block(ROOT_HASH, &[1, 2, 3], 0),
            hash_block(ROOT_HASH, &[1, 2, 3, 0], 0)
        );
        assert_ne!(
            hash_block(ROOT_HASH, &[5], 0),
            hash_block(ROOT_HASH, &[5, 0], 0)
        );
        assert_ne!(
            hash_block(ROOT_HASH, &[], 0),
            hash_block(ROOT_HASH, &[0], 0)
        );
    }

    #[test]
    fn hash_has_no_collisions_over_many_small_blocks() {
        let mut seen = std::collections::HashSet::new();
        for a in 0..64u32 {
            for b in 0..64u32 {
                assert!(seen.insert(hash_block(ROOT_HASH, &[a, b, 0, 0], 0)));
            }
        }
    }

    #[test]
    fn chain_hashes_cover_only_full_blocks() {
        let t: Vec<TokenId> = (0..35).collect();
        let h = chain_hashes(&t, 16, 0);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], hash_block(ROOT_HASH, &t[..16], 0));
        assert_eq!(h[1], hash_block(h[0], &t[16..32], 0));
    }

    #[test]
    fn a_chain_continued_from_a_parent_equals_the_whole_chains_tail() {
        let t: Vec<TokenId> = (0..64).map(|i| i * 7 + 1).collect();
        let whole = chain_hashes(&t, 16, 5);
        assert_eq!(chain_hashes_from(whole[1], &t[32..], 16, 5), whole[2..]);
        assert_eq!(chain_hashes_from(ROOT_HASH, &t, 16, 5), whole);
        // another parent, another chain
        assert_ne!(chain_hashes_from(whole[0], &t[32..], 16, 5), whole[2..]);
    }

    #[test]
    fn register_rejects_taken_hash_and_registered_block() {
        let mut c = PrefixCache::new(4, true);
        assert!(c.register(0, 11));
        assert!(!c.register(1, 11));
        assert!(!c.register(0, 12));
        assert_eq!(c.get(11), Some(0));
        assert_eq!(c.block_hash(1), None);
        c.check().unwrap();
    }

    #[test]
    fn hashes_sharing_a_bucket_find_their_own_blocks() {
        // Same low bits and same top bits: the table puts them in one probe group, and only
        // the block's stored hash tells them apart.
        let (a, b) = (0x0123_4567_89ab_cdef, 0x0123_4567_89ab_cdef ^ (1 << 40));
        let mut c = PrefixCache::new(4, true);
        assert!(c.register(0, a));
        assert!(c.register(1, b));
        assert_eq!((c.get(a), c.get(b)), (Some(0), Some(1)));
        c.evict(0);
        assert_eq!((c.get(a), c.get(b)), (None, Some(1)));
        assert!(c.register(2, a));
        assert_eq!(c.get(a), Some(2));
        c.check().unwrap();
    }

    #[test]
    fn the_reserved_hash_is_never_registered() {
        let mut c = PrefixCache::new(2, true);
        assert!(!c.register(0, NO_HASH));
        assert_eq!((c.get(NO_HASH), c.block_hash(0), c.len()), (None, None, 0));
        c.check().unwrap();
    }

    #[test]
    fn find_stops_at_first_miss_and_keeps_last_token_out() {
        let mut c = PrefixCache::new(8, true);
        let t: Vec<TokenId> = (0..48).collect();
        let h = chain_hashes(&t, 16, 0);
        // All three blocks cached, but a 48-token prompt may reuse only two of them.
        for (i, &hash) in h.iter().enumerate() {
            c.register(i as BlockId, hash);
        }
        let hit = c.find(&t, 16, 0);
        assert_eq!(hit.blocks, vec![0, 1]);
        assert_eq!(hit.num_cached_tokens, 32);
        assert_eq!(hit.hashes, h);
        // A miss in the middle ends the run.
        c.evict(0);
        assert!(c.find(&t, 16, 0).blocks.is_empty());
        assert_eq!(c.stats().evictions, 1);
    }

    #[test]
    fn disabled_cache_finds_nothing_and_registers_nothing() {
        let mut c = PrefixCache::new(2, false);
        assert!(!c.register(0, 1));
        assert_eq!(c.find(&[1, 2, 3, 4, 5], 2, 0), PrefixHit::default());
        c.record(5, 2, 0);
        assert_eq!(c.stats(), PrefixCacheStats::default());
    }

    #[test]
    fn record_counts_hits_and_misses_in_eligible_blocks() {
        let mut c = PrefixCache::new(2, true);
        c.record(33, 16, 1);
        let s = c.stats();
        assert_eq!((s.queries, s.query_blocks, s.hits, s.misses), (1, 2, 1, 1));
        assert!((s.hit_rate() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn clear_drops_every_registration() {
        let mut c = PrefixCache::new(2, true);
        c.register(0, 7);
        c.register(1, 8);
        c.clear();
        assert!(c.is_empty());
        assert!(!c.is_registered(0));
        c.check().unwrap();
    }
}
