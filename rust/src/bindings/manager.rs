//! Python face of the memory manager: `KVCacheManager`, `AllocStatus`, `PrefixHit`, and the
//! block-hash helpers. Arguments arrive as Python ints (`i64`) and are range-checked here so that
//! bad values raise `ValueError` with our message.
//!
//! Python keeps vLLM's names for the two memories (`num_gpu_blocks`, `num_free_cpu_blocks`,
//! `cpu_usage`, ...); the core calls them device and host, and this layer translates.
use std::hint::black_box;
use std::time::Instant;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{non_negative, PagedLLMError};
use crate::ids::{BlockId, SeqId, TokenId};
use crate::kv::prefix_cache::{chain_hashes, hash_block, ROOT_HASH};
use crate::kv::{AllocStatus, CacheConfig, KvCacheManager, PrefixHit};

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
    /// Chain hashes of every full block of the looked-up tokens.
    hashes: Vec<u64>,
}

impl From<PrefixHit> for PyPrefixHit {
    fn from(h: PrefixHit) -> Self {
        Self {
            num_cached_tokens: h.num_cached_tokens,
            blocks: h.blocks,
            hashes: h.hashes,
        }
    }
}

impl PyPrefixHit {
    fn to_core(&self) -> PrefixHit {
        PrefixHit {
            num_cached_tokens: self.num_cached_tokens,
            blocks: self.blocks.clone(),
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

pub(crate) fn seq_id(value: i64) -> PyResult<SeqId> {
    SeqId::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("sequence id must be >= 0, got {value}")))
}

fn seq_ids(values: Vec<i64>) -> PyResult<Vec<SeqId>> {
    values.into_iter().map(seq_id).collect()
}

pub(crate) fn token_ids(values: Vec<i64>) -> PyResult<Vec<TokenId>> {
    values
        .into_iter()
        .map(|t| {
            TokenId::try_from(t)
                .map_err(|_| PyValueError::new_err(format!("token id {t} is out of range")))
        })
        .collect()
}

fn block_id(value: i64) -> PyResult<BlockId> {
    BlockId::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("block id {value} is out of range")))
}

/// The paged KV-cache memory manager: device and host block pools, block tables, fork /
/// copy-on-write, swap and the prefix cache.
#[pyclass(name = "KVCacheManager", module = "pagedllm._core")]
pub(crate) struct PyKvCacheManager {
    inner: KvCacheManager,
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (*, num_gpu_blocks, block_size = 16, num_cpu_blocks = 0, watermark = 0.01,
                        enable_prefix_caching = true))]
    fn new(
        num_gpu_blocks: i64,
        block_size: i64,
        num_cpu_blocks: i64,
        watermark: f64,
        enable_prefix_caching: bool,
    ) -> PyResult<Self> {
        let config = CacheConfig {
            block_size: non_negative("block_size", block_size)?,
            num_device_blocks: non_negative("num_gpu_blocks", num_gpu_blocks)?,
            num_host_blocks: non_negative("num_cpu_blocks", num_cpu_blocks)?,
            watermark,
            enable_prefix_caching,
        };
        Ok(Self {
            inner: KvCacheManager::new(config)?,
        })
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "KVCacheManager(block_size={}, num_gpu_blocks={}, num_cpu_blocks={}, free_gpu={}, \
             free_cpu={}, sequences={})",
            c.block_size,
            c.num_device_blocks,
            c.num_host_blocks,
            self.inner.num_free_device_blocks(),
            self.inner.num_free_host_blocks(),
            self.inner.num_sequences()
        )
    }

    // ---- allocation ---------------------------------------------------------------------

    /// Counted prefix lookup + allocation. Returns the number of reused (cached) tokens, or None
    /// when the free blocks do not suffice (nothing changes then).
    #[pyo3(signature = (seq_id, token_ids, *, num_slots = None, extra_key = 0,
                        apply_watermark = true))]
    fn allocate(
        &mut self,
        seq_id: i64,
        token_ids: Vec<i64>,
        num_slots: Option<i64>,
        extra_key: u64,
        apply_watermark: bool,
    ) -> PyResult<Option<usize>> {
        let seq = self::seq_id(seq_id)?;
        let tokens = self::token_ids(token_ids)?;
        let num_slots = num_slots
            .map(|n| non_negative("num_slots", n))
            .transpose()?;
        Ok(self
            .inner
            .allocate_prompt(seq, &tokens, num_slots, extra_key, apply_watermark)?)
    }

    /// Allocates from a `PrefixHit` obtained by `lookup`. Returns False (no change) when the free
    /// blocks do not suffice; raises ValueError for a stale hit.
    #[pyo3(signature = (seq_id, hit, num_slots, *, apply_watermark = true))]
    fn allocate_hit(
        &mut self,
        seq_id: i64,
        hit: PyRef<'_, PyPrefixHit>,
        num_slots: i64,
        apply_watermark: bool,
    ) -> PyResult<bool> {
        let seq = self::seq_id(seq_id)?;
        let num_slots = non_negative("num_slots", num_slots)?;
        Ok(self
            .inner
            .allocate(seq, &hit.to_core(), num_slots, apply_watermark)?)
    }

    /// Prefix lookup. Read-only unless `count=True`, which counts it in the hit/miss stats.
    #[pyo3(signature = (token_ids, *, extra_key = 0, count = false))]
    fn lookup(
        &mut self,
        token_ids: Vec<i64>,
        extra_key: u64,
        count: bool,
    ) -> PyResult<PyPrefixHit> {
        let tokens = self::token_ids(token_ids)?;
        let hit = if count {
            self.inner.lookup_prefix(&tokens, extra_key)
        } else {
            self.inner.find_prefix(&tokens, extra_key)
        };
        Ok(hit.into())
    }

    /// Grows the table to `num_slots` slots, copying shared blocks the new slots write into.
    /// Returns the (src, dst) copy-on-write pairs, or None (no change) when out of blocks.
    fn append_slots(
        &mut self,
        seq_id: i64,
        first_new_slot: i64,
        num_slots: i64,
    ) -> PyResult<Option<Vec<(BlockId, BlockId)>>> {
        let seq = self::seq_id(seq_id)?;
        let first = non_negative("first_new_slot", first_new_slot)?;
        let num_slots = non_negative("num_slots", num_slots)?;
        Ok(self.inner.append_slots(seq, first, num_slots)?)
    }

    /// Registers the full blocks inside `token_ids[:num_computed_tokens]` in the prefix cache;
    /// returns how many were newly registered.
    #[pyo3(signature = (seq_id, token_ids, num_computed_tokens, *, extra_key = 0))]
    fn cache_full_blocks(
        &mut self,
        seq_id: i64,
        token_ids: Vec<i64>,
        num_computed_tokens: i64,
        extra_key: u64,
    ) -> PyResult<usize> {
        let seq = self::seq_id(seq_id)?;
        let tokens = self::token_ids(token_ids)?;
        let n = non_negative("num_computed_tokens", num_computed_tokens)?;
        Ok(self.inner.cache_full_blocks(seq, &tokens, n, extra_key)?)
    }

    /// The child shares every block of the parent.
    fn fork(&mut self, parent_seq_id: i64, child_seq_id: i64) -> PyResult<()> {
        Ok(self
            .inner
            .fork(seq_id(parent_seq_id)?, seq_id(child_seq_id)?)?)
    }

    /// Releases the sequence's blocks (device or host).
    fn free(&mut self, seq_id: i64) -> PyResult<()> {
        Ok(self.inner.free(self::seq_id(seq_id)?)?)
    }

    // ---- admission ----------------------------------------------------------------------

    fn can_allocate(&self, num_tokens: i64) -> PyResult<PyAllocStatus> {
        Ok(self
            .inner
            .can_allocate(non_negative("num_tokens", num_tokens)?)
            .into())
    }

    fn can_allocate_with_prefix(
        &self,
        hit: PyRef<'_, PyPrefixHit>,
        num_slots: i64,
    ) -> PyResult<PyAllocStatus> {
        let num_slots = non_negative("num_slots", num_slots)?;
        Ok(self
            .inner
            .can_allocate_with_prefix(&hit.to_core(), num_slots)
            .into())
    }

    #[pyo3(signature = (num_running_seqs, num_lookahead_slots = 0))]
    fn can_append_slots(&self, num_running_seqs: i64, num_lookahead_slots: i64) -> PyResult<bool> {
        Ok(self.inner.can_append_slots(
            non_negative("num_running_seqs", num_running_seqs)?,
            non_negative("num_lookahead_slots", num_lookahead_slots)?,
        ))
    }

    // ---- swap ---------------------------------------------------------------------------

    fn can_swap_out(&self, seq_ids: Vec<i64>) -> PyResult<bool> {
        Ok(self.inner.check_swap_out(&self::seq_ids(seq_ids)?)?)
    }

    /// Returns the (device, host) copy pairs.
    fn swap_out(&mut self, seq_ids: Vec<i64>) -> PyResult<Vec<(BlockId, BlockId)>> {
        Ok(self.inner.swap_out(&self::seq_ids(seq_ids)?)?)
    }

    #[pyo3(signature = (seq_ids, num_lookahead_slots = 0))]
    fn can_swap_in(&self, seq_ids: Vec<i64>, num_lookahead_slots: i64) -> PyResult<PyAllocStatus> {
        let seqs = self::seq_ids(seq_ids)?;
        let lookahead = non_negative("num_lookahead_slots", num_lookahead_slots)?;
        Ok(self.inner.check_swap_in(&seqs, lookahead)?.into())
    }

    /// Returns the (host, device) copy pairs.
    fn swap_in(&mut self, seq_ids: Vec<i64>) -> PyResult<Vec<(BlockId, BlockId)>> {
        Ok(self.inner.swap_in(&self::seq_ids(seq_ids)?)?)
    }

    // ---- inspection ---------------------------------------------------------------------

    fn block_table(&self, seq_id: i64) -> PyResult<Vec<BlockId>> {
        Ok(self.inner.block_table(self::seq_id(seq_id)?)?.to_vec())
    }

    fn is_swapped(&self, seq_id: i64) -> PyResult<bool> {
        let seq = self::seq_id(seq_id)?;
        self.inner.table(seq)?;
        Ok(self.inner.is_swapped(seq))
    }

    fn contains(&self, seq_id: i64) -> bool {
        seq_id >= 0 && self.inner.contains(seq_id as SeqId)
    }

    fn __contains__(&self, seq_id: i64) -> bool {
        self.contains(seq_id)
    }

    fn seq_ids(&self) -> Vec<SeqId> {
        let mut ids: Vec<SeqId> = self.inner.seq_ids().collect();
        ids.sort_unstable();
        ids
    }

    /// Ref count of a device block (or of a host block with `device=False`).
    #[pyo3(signature = (block_id, *, device = true))]
    fn ref_count(&self, block_id: i64, device: bool) -> PyResult<u32> {
        let block = self::block_id(block_id)?;
        let count = if device {
            self.inner.device_ref_count(block)
        } else {
            self.inner.host_ref_count(block)
        };
        count.ok_or_else(|| {
            let pool = if device { "device" } else { "host" };
            PyValueError::new_err(format!("{pool} block id {block_id} is out of range"))
        })
    }

    /// Hash a device block is registered under in the prefix cache, or None.
    fn block_hash(&self, block_id: i64) -> PyResult<Option<u64>> {
        let block = self::block_id(block_id)?;
        if block as usize >= self.inner.num_device_blocks() {
            return Err(PyValueError::new_err(format!(
                "device block id {block_id} is out of range"
            )));
        }
        Ok(self.inner.block_hash(block))
    }

    /// Cached device blocks in eviction order (first evicted first).
    fn evictable_blocks(&self) -> Vec<BlockId> {
        self.inner.evictable_blocks()
    }

    /// Fraction of device blocks in use.
    fn usage(&self) -> f64 {
        self.inner.device_usage()
    }

    /// Fraction of host blocks in use.
    fn cpu_usage(&self) -> f64 {
        self.inner.host_usage()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("block_size", s.block_size)?;
        d.set_item("num_gpu_blocks", s.num_device_blocks)?;
        d.set_item("num_cpu_blocks", s.num_host_blocks)?;
        d.set_item("num_free_gpu_blocks", s.num_free_device_blocks)?;
        d.set_item("num_free_cpu_blocks", s.num_free_host_blocks)?;
        d.set_item("num_cached_gpu_blocks", s.num_cached_device_blocks)?;
        d.set_item("num_registered_blocks", s.num_registered_blocks)?;
        d.set_item("num_sequences", s.num_sequences)?;
        d.set_item("num_swapped_sequences", s.num_swapped_sequences)?;
        d.set_item("gpu_usage", s.device_usage)?;
        d.set_item("cpu_usage", s.host_usage)?;
        d.set_item("watermark_blocks", s.watermark_blocks)?;
        let p = s.prefix_cache;
        d.set_item("prefix_cache_queries", p.queries)?;
        d.set_item("prefix_cache_query_blocks", p.query_blocks)?;
        d.set_item("prefix_cache_hits", p.hits)?;
        d.set_item("prefix_cache_misses", p.misses)?;
        d.set_item("prefix_cache_evictions", p.evictions)?;
        d.set_item("prefix_cache_hit_rate", p.hit_rate())?;
        Ok(d)
    }

    /// Raises PagedLLMError naming the first violated invariant.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(PagedLLMError::new_err)
    }

    fn reset_prefix_cache(&mut self) {
        self.inner.reset_prefix_cache()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn num_gpu_blocks(&self) -> usize {
        self.inner.num_device_blocks()
    }

    #[getter]
    fn num_cpu_blocks(&self) -> usize {
        self.inner.num_host_blocks()
    }

    #[getter]
    fn num_free_gpu_blocks(&self) -> usize {
        self.inner.num_free_device_blocks()
    }

    #[getter]
    fn num_free_cpu_blocks(&self) -> usize {
        self.inner.num_free_host_blocks()
    }

    #[getter]
    fn num_cached_gpu_blocks(&self) -> usize {
        self.inner.num_cached_device_blocks()
    }

    #[getter]
    fn num_sequences(&self) -> usize {
        self.inner.num_sequences()
    }

    #[getter]
    fn watermark_blocks(&self) -> usize {
        self.inner.watermark_blocks()
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }
}

/// Chained hash of one block (`parent_hash` = ROOT_HASH for a sequence's first block).
#[pyfunction]
#[pyo3(name = "hash_block", signature = (parent_hash, token_ids, extra_key = 0))]
fn py_hash_block(parent_hash: u64, token_ids: Vec<i64>, extra_key: u64) -> PyResult<u64> {
    Ok(hash_block(
        parent_hash,
        &self::token_ids(token_ids)?,
        extra_key,
    ))
}

/// Chain hashes of every full block of `token_ids`.
#[pyfunction]
#[pyo3(name = "hash_block_chain", signature = (token_ids, block_size, extra_key = 0))]
fn py_hash_block_chain(token_ids: Vec<i64>, block_size: i64, extra_key: u64) -> PyResult<Vec<u64>> {
    let block_size = non_negative("block_size", block_size)?;
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be > 0, got 0"));
    }
    Ok(chain_hashes(
        &self::token_ids(token_ids)?,
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
    m.add_class::<PyKvCacheManager>()?;
    m.add_class::<PyAllocStatus>()?;
    m.add_class::<PyPrefixHit>()?;
    m.add("ROOT_HASH", ROOT_HASH)?;
    m.add_function(wrap_pyfunction!(py_hash_block, m)?)?;
    m.add_function(wrap_pyfunction!(py_hash_block_chain, m)?)?;
    m.add_function(wrap_pyfunction!(time_hash_block, m)?)?;
    Ok(())
}
