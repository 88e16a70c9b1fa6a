//! The KV-cache memory manager (docs/ARCHITECTURE.md §1): device and host block pools,
//! per-sequence block tables, fork / copy-on-write, swap, and the prefix cache.
//!
//! The parts, each owning its state: [`block_pool`] (one pool's ref counts, free stack and
//! LRU list), [`block_table`] (one sequence's blocks and hash chain), [`prefix_cache`] (the
//! hash -> block map). [`KvCacheManager`] owns one of each pool, the prefix cache and the
//! tables; its operations are split by kind over the private modules below. Every fallible
//! operation validates everything before it mutates anything, so an `Err` (or an `Ok(false)` /
//! `Ok(None)` "not enough blocks" answer) leaves the manager exactly as it was.
pub mod block_pool;
pub mod block_table;
pub mod events;
pub mod prefix_cache;

mod admission;
mod allocate;
mod fork;
mod groups;
mod invariants;
mod manager;
mod register;
mod swap;
mod truncate;

#[cfg(test)]
mod manager_proptest;
#[cfg(test)]
mod testing;

pub use admission::AllocStatus;
pub use block_pool::BlockState;
pub use block_table::{BlockTable, Location, NULL_BLOCK};
pub use events::{KvEventBatch, KvEventKind, KvEventLog};
pub use groups::{blocks_behind_window, max_blocks_held};
pub use manager::{defaults, CacheConfig, CacheStats, KvCacheManager};
pub use prefix_cache::{salted_key, IdBuildHasher, PrefixCacheStats, PrefixHit};
