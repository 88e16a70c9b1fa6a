//! CPU kernels of the engine's CPU execution path (the model's hot loops that torch does not
//! cover well): paged attention straight over the block-paged KV cache, rotary embedding in
//! place, linear layers over weights packed into column panels (`linear`), RMS norm (with the
//! residual add fused in), SwiGLU's activation, greedy sampling's argmax. Each kernel takes f32 or bf16 tensors (`elem`),
//! computing in f32.
//!
//! Plain Rust over `ndarray` views, so `cargo test` runs them without Python; the bindings
//! (`bindings/cpu_ops.rs`) view torch CPU tensors as numpy arrays without a copy.
pub mod activation;
pub mod argmax;
pub mod attention;
mod attention_avx2;
mod attention_avx512;
pub mod elem;
pub mod forward;
pub mod isa;
pub mod kv_quant;
pub mod linear;
#[cfg(target_arch = "x86_64")]
mod linear_avx512;
pub mod moe;
pub mod norm;
mod pool;
pub mod quant;
pub mod rotary;
mod simd;
#[cfg(target_arch = "x86_64")]
mod simd_avx512;
pub mod views;

#[cfg(test)]
mod attention_tests;

pub use activation::silu_and_mul;
pub use argmax::argmax_rows;
pub use attention::{paged_attention, store_kv, store_kv_fed, PagedBatch, Scores};
pub use elem::{Bf16, Elem};
pub use kv_quant::{Fp8E4M3, Fp8E5M2, KvElem, I8};
pub use linear::{linear, pack_panels, PANEL};
pub use moe::{moe_experts, moe_quant_experts, QuantExperts, QuantLayout};
pub use norm::{add_rms_norm, rms_norm};
pub use rotary::rotary_in_place;

/// A kernel's argument error (the bindings raise it as ValueError).
fn invalid(msg: impl Into<String>) -> crate::error::Error {
    crate::error::Error::InvalidArgument(msg.into())
}
