//! Speculative decoding's proposers that run over the token histories the scheduler holds
//! (a leaf over token slices: it knows nothing of requests, blocks or Python).
//!
//! - [`ngram`]: prompt lookup — the tokens that followed the latest earlier occurrence of the
//!   history's suffix.
pub mod ngram;

pub use ngram::{propose_ngram, NgramConfig};
