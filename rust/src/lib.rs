//! pagedllm core: KV-cache memory manager and scheduler.
//!
//! Everything here except `bindings` is plain Rust with no Python types, so
//! `cargo test` runs without an interpreter.

/// Sequence id (one per running sample; a request with n > 1 has n of them).
pub type SeqId = u64;
/// Physical block id within one pool (device and host ids are independent).
pub type BlockId = u32;
/// Token id.
pub type TokenId = u32;

pub mod block_pool;
pub mod block_table;
pub mod error;
pub mod kv_cache_manager;
pub mod prefix_cache;
pub mod scheduler;

pub use error::{Error, Result};
pub use kv_cache_manager::{AllocStatus, CacheConfig, CacheStats, KvCacheManager, PrefixHit};

#[cfg(test)]
mod kv_cache_manager_proptest;

#[cfg(feature = "python")]
mod bindings;
