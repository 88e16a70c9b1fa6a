//! pagedllm core: KV-cache memory manager and scheduler.
//!
//! Everything here except `bindings` is plain Rust with no Python types, so
//! `cargo test` runs without an interpreter.

#[cfg(feature = "python")]
mod bindings;
