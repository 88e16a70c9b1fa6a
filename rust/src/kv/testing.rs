//! Helpers shared by the `kv` unit tests.
use super::{CacheConfig, KvCacheManager};
use crate::ids::{SeqId, TokenId};

/// A manager with no watermark.
pub(super) fn manager(block_size: usize, device: usize, host: usize) -> KvCacheManager {
    let mut cfg = CacheConfig::new(block_size, device, host);
    cfg.watermark = 0.0;
    KvCacheManager::new(cfg).unwrap()
}

/// `allocate_prompt` with every token a slot, then the invariants.
pub(super) fn alloc(m: &mut KvCacheManager, seq: SeqId, tokens: &[TokenId]) -> Option<usize> {
    let r = m.allocate_prompt(seq, tokens, None, 0, false).unwrap();
    m.check_invariants().unwrap();
    r
}

pub(super) fn toks(range: std::ops::Range<u32>) -> Vec<TokenId> {
    range.collect()
}
