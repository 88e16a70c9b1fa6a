//! Python face of the memory manager: `KVCacheManager`, `AllocStatus`, `PrefixHit`, and the
//! block-hash helpers. Arguments arrive as Python ints (`i64`) and are range-checked here so that
//! bad values raise `ValueError` with our message.
//!
//! Python keeps vLLM's names for the two memories (`num_gpu_blocks`, `num_free_cpu_blocks`,
//! `cpu_usage`, ...); the core calls them device and host, and this layer translates.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{non_negative, PagedLLMError};
use super::kv_args;
use super::kv_types::{PyAllocStatus, PyPrefixHit};
use crate::ids::{BlockId, SeqId};
use crate::kv::{defaults, CacheConfig, CacheStats, KvCacheManager};

/// The paged KV-cache memory manager: device and host block pools, block tables, fork /
/// copy-on-write, swap and the prefix cache.
#[pyclass(name = "KVCacheManager", module = "pagedllm._core")]
pub(crate) struct PyKvCacheManager {
    inner: KvCacheManager,
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (*, num_gpu_blocks, block_size = defaults::BLOCK_SIZE as i64,
                        num_cpu_blocks = 0, watermark = defaults::WATERMARK,
                        enable_prefix_caching = defaults::ENABLE_PREFIX_CACHING))]
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
        repr(&self.inner)
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
        let seq = kv_args::seq_id(seq_id)?;
        let tokens = kv_args::token_ids(token_ids)?;
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
        let seq = kv_args::seq_id(seq_id)?;
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
        let tokens = kv_args::token_ids(token_ids)?;
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
        let seq = kv_args::seq_id(seq_id)?;
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
        let seq = kv_args::seq_id(seq_id)?;
        let tokens = kv_args::token_ids(token_ids)?;
        let n = non_negative("num_computed_tokens", num_computed_tokens)?;
        Ok(self.inner.cache_full_blocks(seq, &tokens, n, extra_key)?)
    }

    /// The child shares every block of the parent.
    fn fork(&mut self, parent_seq_id: i64, child_seq_id: i64) -> PyResult<()> {
        Ok(self.inner.fork(
            kv_args::seq_id(parent_seq_id)?,
            kv_args::seq_id(child_seq_id)?,
        )?)
    }

    /// Releases the sequence's blocks (device or host).
    fn free(&mut self, seq_id: i64) -> PyResult<()> {
        Ok(self.inner.free(kv_args::seq_id(seq_id)?)?)
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
        Ok(self.inner.check_swap_out(&kv_args::seq_ids(seq_ids)?)?)
    }

    /// Returns the (device, host) copy pairs.
    fn swap_out(&mut self, seq_ids: Vec<i64>) -> PyResult<Vec<(BlockId, BlockId)>> {
        Ok(self.inner.swap_out(&kv_args::seq_ids(seq_ids)?)?)
    }

    #[pyo3(signature = (seq_ids, num_lookahead_slots = 0))]
    fn can_swap_in(&self, seq_ids: Vec<i64>, num_lookahead_slots: i64) -> PyResult<PyAllocStatus> {
        let seqs = kv_args::seq_ids(seq_ids)?;
        let lookahead = non_negative("num_lookahead_slots", num_lookahead_slots)?;
        Ok(self.inner.check_swap_in(&seqs, lookahead)?.into())
    }

    /// Returns the (host, device) copy pairs.
    fn swap_in(&mut self, seq_ids: Vec<i64>) -> PyResult<Vec<(BlockId, BlockId)>> {
        Ok(self.inner.swap_in(&kv_args::seq_ids(seq_ids)?)?)
    }

    // ---- inspection ---------------------------------------------------------------------

    fn block_table(&self, seq_id: i64) -> PyResult<Vec<BlockId>> {
        Ok(self.inner.block_table(kv_args::seq_id(seq_id)?)?.to_vec())
    }

    fn is_swapped(&self, seq_id: i64) -> PyResult<bool> {
        let seq = kv_args::seq_id(seq_id)?;
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
        ref_count(&self.inner, block_id, device)
    }

    /// Hash a device block is registered under in the prefix cache, or None.
    fn block_hash(&self, block_id: i64) -> PyResult<Option<u64>> {
        block_hash(&self.inner, block_id)
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
        stats_dict(py, &self.inner.stats())
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

/// `repr()`: the configuration and the free blocks, under the Python names.
fn repr(mgr: &KvCacheManager) -> String {
    let c = mgr.config();
    format!(
        "KVCacheManager(block_size={}, num_gpu_blocks={}, num_cpu_blocks={}, free_gpu={}, \
         free_cpu={}, sequences={})",
        c.block_size,
        c.num_device_blocks,
        c.num_host_blocks,
        mgr.num_free_device_blocks(),
        mgr.num_free_host_blocks(),
        mgr.num_sequences()
    )
}

/// The pools' block counts, under the Python names (gpu/cpu for the core's device/host): in
/// the manager's stats and the scheduler's.
pub(crate) fn set_pool_counts(d: &Bound<'_, PyDict>, s: &CacheStats) -> PyResult<()> {
    d.set_item("num_gpu_blocks", s.num_device_blocks)?;
    d.set_item("num_cpu_blocks", s.num_host_blocks)?;
    d.set_item("num_free_gpu_blocks", s.num_free_device_blocks)?;
    d.set_item("num_free_cpu_blocks", s.num_free_host_blocks)?;
    d.set_item("num_cached_gpu_blocks", s.num_cached_device_blocks)
}

/// The prefix cache's counters (in blocks): in the manager's stats and the scheduler's.
pub(crate) fn set_prefix_counters(d: &Bound<'_, PyDict>, s: &CacheStats) -> PyResult<()> {
    let p = &s.prefix_cache;
    d.set_item("prefix_cache_queries", p.queries)?;
    d.set_item("prefix_cache_query_blocks", p.query_blocks)?;
    d.set_item("prefix_cache_hits", p.hits)?;
    d.set_item("prefix_cache_misses", p.misses)?;
    d.set_item("prefix_cache_evictions", p.evictions)?;
    d.set_item("prefix_cache_hit_rate", p.hit_rate())
}

/// `stats()` as a dict, under the Python names.
fn stats_dict<'py>(py: Python<'py>, s: &CacheStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("block_size", s.block_size)?;
    set_pool_counts(&d, s)?;
    d.set_item("num_registered_blocks", s.num_registered_blocks)?;
    d.set_item("num_sequences", s.num_sequences)?;
    d.set_item("num_swapped_sequences", s.num_swapped_sequences)?;
    d.set_item("gpu_usage", s.device_usage)?;
    d.set_item("cpu_usage", s.host_usage)?;
    d.set_item("watermark_blocks", s.watermark_blocks)?;
    set_prefix_counters(&d, s)?;
    Ok(d)
}

/// `ref_count()`: a block id outside its pool raises ValueError.
fn ref_count(mgr: &KvCacheManager, id: i64, device: bool) -> PyResult<u32> {
    let block = kv_args::block_id(id)?;
    let count = if device {
        mgr.device_ref_count(block)
    } else {
        mgr.host_ref_count(block)
    };
    count.ok_or_else(|| {
        let pool = if device { "device" } else { "host" };
        PyValueError::new_err(format!("{pool} block id {id} is out of range"))
    })
}

/// `block_hash()`: a block id outside the device pool raises ValueError.
fn block_hash(mgr: &KvCacheManager, id: i64) -> PyResult<Option<u64>> {
    let block = kv_args::block_id(id)?;
    if block as usize >= mgr.num_device_blocks() {
        return Err(PyValueError::new_err(format!(
            "device block id {id} is out of range"
        )));
    }
    Ok(mgr.block_hash(block))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvCacheManager>()?;
    m.add_class::<PyAllocStatus>()?;
    m.add_class::<PyPrefixHit>()?;
    super::block_hash::register(m)
}
