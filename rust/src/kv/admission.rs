//! Admission: the OK / LATER / NEVER answers for new sequences and swap-ins (one ladder
//! behind all of them), and the conservative room check for a step's appends.
use super::block_pool::BlockState;
use super::block_table::blocks_for;
use super::manager::{CacheConfig, KvCacheManager};
use super::prefix_cache::PrefixHit;

/// Answer of the admission checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocStatus {
    /// Fits now.
    Ok,
    /// Does not fit now, may fit once blocks are freed.
    Later,
    /// Can never fit in this pool.
    Never,
}

/// What a sequence (or a swapped-out group) asks of the device pool.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ask {
    /// Blocks its tables hold once it is in.
    pub total: usize,
    /// Of those, the blocks taken from the free pool (fresh ones and revived cached ones).
    pub taken: usize,
    /// Blocks of the pool it may never use: the watermark for a new sequence, none for a
    /// swap-in (as vLLM V0).
    pub off_limits: usize,
    /// Free blocks that must remain once it is in (the watermark, where kept).
    pub reserve: usize,
}

impl CacheConfig {
    /// The fewest device blocks a cache of this block size and watermark needs so that a new
    /// sequence of `num_tokens` tokens is ever admitted (`can_allocate` is not NEVER): its
    /// blocks plus the watermark's share of the pool. Start-up sizing asks this.
    pub fn min_device_blocks(&self, num_tokens: usize) -> usize {
        self.min_pool_for(blocks_for(num_tokens, self.block_size))
    }

    /// The fewest device blocks that leave `needed` outside the watermark's share.
    pub fn min_pool_for(&self, needed: usize) -> usize {
        let usable = |num_device_blocks| {
            let cfg = CacheConfig {
                num_device_blocks,
                ..self.clone()
            };
            num_device_blocks - cfg.watermark_blocks()
        };
        // The pool less its watermark grows by at most one block per block, so the smallest
        // pool that leaves `needed` is reached by stepping up the shortfall (few steps: the
        // watermark is a fraction below 1).
        let mut n = needed;
        while usable(n) < needed {
            n += needed - usable(n);
        }
        n
    }
}

impl KvCacheManager {
    /// The one admission ladder: NEVER when the ask exceeds what the pool can ever give,
    /// LATER when too few blocks are free now, else OK.
    #[inline]
    pub(super) fn admission(&self, ask: Ask) -> AllocStatus {
        if ask.total > self.device.num_blocks() - ask.off_limits {
            AllocStatus::Never
        } else if self.device.num_free() < ask.taken + ask.reserve {
            AllocStatus::Later
        } else {
            AllocStatus::Ok
        }
    }

    /// A new sequence's ask: it keeps the watermark, for good and now.
    fn new_sequence_ask(&self, total: usize, taken: usize) -> Ask {
        Ask {
            total,
            taken,
            off_limits: self.watermark_blocks,
            reserve: self.watermark_blocks,
        }
    }

    /// OK / LATER / NEVER for a new sequence of `num_tokens` tokens with no prefix hit.
    pub fn can_allocate(&self, num_tokens: usize) -> AllocStatus {
        // Every group takes its blocks; a window group at most its window and one chunk
        // (`max_blocks_held`; a prompt's one-chunk prefill writes all of them).
        let needed = match self.hybrid {
            false => blocks_for(num_tokens, self.config.block_size),
            true => self.max_blocks_held(num_tokens),
        };
        self.admission(self.new_sequence_ask(needed, needed))
    }

    /// Like `can_allocate`, but counting only the blocks `allocate(hit, num_slots)` would take
    /// from the free pool (fresh blocks plus cached hit blocks it revives).
    pub fn can_allocate_with_prefix(&self, hit: &PrefixHit, num_slots: usize) -> AllocStatus {
        let total = blocks_for(num_slots, self.config.block_size) * self.windows.len();
        let taken = self.num_blocks_to_allocate(hit, num_slots);
        self.admission(self.new_sequence_ask(total, taken))
    }

    /// Free blocks `allocate(hit, num_slots)` consumes.
    pub fn num_blocks_to_allocate(&self, hit: &PrefixHit, num_slots: usize) -> usize {
        if self.hybrid {
            return self.hybrid_blocks_to_allocate(hit, num_slots);
        }
        let total = blocks_for(num_slots, self.config.block_size);
        let revived = hit
            .blocks
            .iter()
            .filter(|&&b| self.device.state(b) == Some(BlockState::Cached))
            .count();
        total.saturating_sub(hit.blocks.len()) + revived
    }

    /// Conservative: one block per running sequence (a new block or a CoW copy) plus the blocks
    /// its lookahead slots may spill into.
    pub fn can_append_slots(&self, num_running_seqs: usize, num_lookahead_slots: usize) -> bool {
        let per_seq =
            (1 + blocks_for(num_lookahead_slots, self.config.block_size)) * self.windows.len();
        self.device.num_free() >= num_running_seqs.saturating_mul(per_seq)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{alloc, manager, toks};
    use super::super::{CacheConfig, KvCacheManager};
    use super::*;

    #[test]
    fn can_allocate_answers_ok_later_never() {
        let mut cfg = CacheConfig::new(4, 10, 0);
        cfg.watermark = 0.1; // 1 block
        let mut m = KvCacheManager::new(cfg).unwrap();
        assert_eq!(m.can_allocate(36), AllocStatus::Ok); // 9 blocks + 1 watermark = 10
        assert_eq!(m.can_allocate(37), AllocStatus::Never); // 10 > 10 - 1
        m.allocate_prompt(1, &toks(0..8), None, 0, true)
            .unwrap()
            .unwrap();
        assert_eq!(m.can_allocate(28), AllocStatus::Ok); // 8 free - 7 = 1
        assert_eq!(m.can_allocate(29), AllocStatus::Later); // 8 free - 8 = 0 < 1
    }

    #[test]
    fn can_append_slots_counts_one_block_per_seq_plus_lookahead() {
        let mut m = manager(4, 4, 0);
        assert!(m.can_append_slots(4, 0));
        assert!(!m.can_append_slots(5, 0));
        assert!(m.can_append_slots(2, 4)); // 2 * (1 + 1)
        assert!(!m.can_append_slots(2, 5)); // 2 * (1 + 2)
        alloc(&mut m, 1, &toks(0..4));
        assert!(!m.can_append_slots(4, 0));
    }

    #[test]
    fn min_device_blocks_is_the_smallest_pool_that_admits_the_sequence() {
        for watermark in [0.0, 0.01, 0.1, 0.25, 0.5, 0.9] {
            for num_tokens in [1, 4, 5, 64, 257, 2048] {
                let mut cfg = CacheConfig::new(4, 0, 0);
                cfg.watermark = watermark;
                let n = cfg.min_device_blocks(num_tokens);
                let status = |num_device_blocks| {
                    let cfg = CacheConfig {
                        num_device_blocks,
                        ..cfg.clone()
                    };
                    KvCacheManager::new(cfg).unwrap().can_allocate(num_tokens)
                };
                assert_ne!(status(n), AllocStatus::Never, "{watermark} {num_tokens}");
                assert_eq!(
                    status(n - 1),
                    AllocStatus::Never,
                    "{watermark} {num_tokens}"
                );
            }
        }
    }

    #[test]
    fn one_ladder_serves_new_sequences_and_swap_ins() {
        // 10 device blocks, watermark 2: a new sequence may never use the watermark's
        // blocks, a swap-in may (it only waits while they are needed to keep it free).
        let mut cfg = CacheConfig::new(4, 10, 10);
        cfg.watermark = 0.2;
        let m = KvCacheManager::new(cfg).unwrap();
        let ask = |total, off_limits, reserve| {
            m.admission(Ask {
                total,
                taken: total,
                off_limits,
                reserve,
            })
        };
        assert_eq!(ask(8, 2, 2), AllocStatus::Ok);
        assert_eq!(ask(9, 2, 2), AllocStatus::Never);
        assert_eq!(ask(9, 0, 2), AllocStatus::Later);
        assert_eq!(ask(10, 0, 0), AllocStatus::Ok);
        assert_eq!(ask(11, 0, 0), AllocStatus::Never);
        assert_eq!(m.can_allocate(36), ask(9, 2, 2));
    }
}
