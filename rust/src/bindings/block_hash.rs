//! The prefix cache's block hash, exposed for tests and benchmarks: `hash_block`,
//! `hash_block_chain`, `ROOT_HASH` and the in-Rust timing loop `_time_hash_block`.
use std::hint::black_box;
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors::non_negative;
use super::kv_args;
use crate::ids::TokenId;
use crate::kv::prefix_cache::{chain_hashes_from, hash_block, ROOT_HASH};

/// Chained hash of one block (`parent_hash` = ROOT_HASH for a sequence's first block).
#[pyfunction]
#[pyo3(name = "hash_block", signature = (parent_hash, token_ids, extra_key = 0))]
fn py_hash_block(parent_hash: u64, token_ids: Vec<i64>, extra_key: u64) -> PyResult<u64> {
    Ok(hash_block(
        parent_hash,
        &kv_args::token_ids(token_ids)?,
        extra_key,
    ))
}

/// Chain hashes of every full block of `token_ids`, continuing the chain whose last block hashed
/// to `parent_hash` (ROOT_HASH: from a sequence's first block).
#[pyfunction]
#[pyo3(
    name = "hash_block_chain",
    signature = (token_ids, block_size, extra_key = 0, parent_hash = ROOT_HASH)
)]
fn py_hash_block_chain(
    token_ids: Vec<i64>,
    block_size: i64,
    extra_key: u64,
    parent_hash: u64,
) -> PyResult<Vec<u64>> {
    let block_size = non_negative("block_size", block_size)?;
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be > 0, got 0"));
    }
    Ok(chain_hashes_from(
        parent_hash,
        &kv_args::token_ids(token_ids)?,
        block_size,
        extra_key,
    ))
}

/// Times `iterations` chained hashes of `block_size`-token blocks inside Rust (no Python call
/// per hash) and returns nanoseconds per block hash. For benchmarks.
#[pyfunction]
#[pyo3(name = "_time_hash_block", signature = (block_size, iterations = 1_000_000))]
fn time_hash_block(py: Python<'_>, block_size: i64, iterations: i64) -> PyResult<f64> {
    let block_size = non_negative("block_size", block_size)?;
    let iterations = non_negative("iterations", iterations)?.max(1);
    let tokens: Vec<TokenId> = (0..block_size as TokenId)
        .map(|t| t.wrapping_mul(7919))
        .collect();
    let elapsed = py.detach(|| {
        let start = Instant::now();
        let mut parent = ROOT_HASH;
        for _ in 0..iterations {
            // Chaining makes each hash depend on the previous one, so none can be skipped.
            parent = hash_block(black_box(parent), black_box(&tokens), 0);
        }
        black_box(parent);
        start.elapsed()
    });
    Ok(elapsed.as_nanos() as f64 / iterations as f64)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ROOT_HASH", ROOT_HASH)?;
    m.add_function(wrap_pyfunction!(py_hash_block, m)?)?;
    m.add_function(wrap_pyfunction!(py_hash_block_chain, m)?)?;
    m.add_function(wrap_pyfunction!(time_hash_block, m)?)?;
    Ok(())
}
