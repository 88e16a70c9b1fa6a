//! pagedllm core: KV-cache memory manager and scheduler.
//!
//! Layers, lowest first; a module imports only from the ones before it:
//! - [`ids`], [`error`]: the shared id types and the error type (leaves);
//! - [`kv`]: the KV-cache memory manager (block pools, block tables, prefix cache, swap);
//! - [`connector`]: KV connectors, the scheduler's side of a second KV tier (the native host
//!   offload tier's index), keyed by `kv`'s block hashes;
//! - [`spec`]: speculative decoding's proposers over token histories (n-gram lookup);
//! - [`router`]: data-parallel routing over replicas' prefix caches (KV events), over `kv`;
//! - [`scheduler`]: requests, queues and steps, asking `kv` for blocks and `spec` for drafts;
//! - [`cpu`]: CPU kernels of the model's forward pass (paged attention), independent of the rest;
//! - [`dist`]: shared-memory transports of tensor-parallel ranks on one host (all-reduce, the
//!   step broadcast ring), independent of the rest;
//! - `bindings` (feature `python`): the `pagedllm._core` extension module over both.
//!
//! Everything except `bindings` is plain Rust with no Python types, so `cargo test` runs
//! without an interpreter.
pub mod connector;
pub mod cpu;
pub mod dist;
pub mod error;
pub mod ids;
pub mod kv;
pub mod router;
pub mod scheduler;
pub mod spec;

#[cfg(feature = "python")]
mod bindings;

pub use error::{Error, Result};
pub use ids::{BlockId, SeqId, TokenId};
pub use kv::{AllocStatus, CacheConfig, CacheStats, KvCacheManager, PrefixHit};
pub use scheduler::{Scheduler, SchedulerConfig, StepOutput};
