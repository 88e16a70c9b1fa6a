//! Values the memory manager's Python face returns: `AllocStatus` and `PrefixHit`.
use pyo3::prelude::*;

use crate::ids::BlockId;
use crate::kv::{AllocStatus, PrefixHit};

/// Admission answer: OK (fits now), LATER (fits once blocks are freed), NEVER (cannot fit).
#[pyclass(
    name = "AllocStatus",
    module = "pagedllm._core",
    eq,
    eq_int,
    frozen,
    hash
)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) enum PyAllocStatus {
    #[pyo3(name = "OK")]
    Ok,
    #[pyo3(name = "LATER")]
    Later,
    #[pyo3(name = "NEVER")]
    Never,
}

impl From<AllocStatus> for PyAllocStatus {
    fn from(s: AllocStatus) -> Self {
        match s {
            AllocStatus::Ok => PyAllocStatus::Ok,
            AllocStatus::Later => PyAllocStatus::Later,
            AllocStatus::Never => PyAllocStatus::Never,
        }
    }
}

/// Result of a prefix lookup.
#[pyclass(name = "PrefixHit", module = "pagedllm._core", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct PyPrefixHit {
    /// Tokens covered by `blocks`.
    num_cached_tokens: usize,
    /// Device blocks of the longest run of leading cached full blocks.
    blocks: Vec<BlockId>,
    /// A hybrid manager's layer groups 1.. (rows like `blocks`; empty otherwise).
    others: Vec<Vec<BlockId>>,
    /// Chain hashes of every full block of the looked-up tokens.
    hashes: Vec<u64>,
}

impl From<PrefixHit> for PyPrefixHit {
    fn from(h: PrefixHit) -> Self {
        Self {
            num_cached_tokens: h.num_cached_tokens,
            blocks: h.blocks,
            others: h.others,
            hashes: h.hashes,
        }
    }
}

impl PyPrefixHit {
    pub(crate) fn to_core(&self) -> PrefixHit {
        PrefixHit {
            num_cached_tokens: self.num_cached_tokens,
            blocks: self.blocks.clone(),
            others: self.others.clone(),
            hashes: self.hashes.clone(),
        }
    }
}

#[pymethods]
impl PyPrefixHit {
    fn __repr__(&self) -> String {
        format!(
            "PrefixHit(num_cached_tokens={}, blocks={:?}, num_hashes={})",
            self.num_cached_tokens,
            self.blocks,
            self.hashes.len()
        )
    }
}
