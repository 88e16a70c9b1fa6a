//! Python face of the data-parallel router core (`crate::router`): `Router` (routing
//! decisions, the prefix index fed with KV-event arrays, per-replica load and counters),
//! `ROUTING_POLICIES` and `MAX_ROUTER_REPLICAS`.
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::non_negative;
use super::kv_args;
use crate::kv::events::Medium;
use crate::router::{defaults, Applied, Router, RouterConfig, RoutingPolicy, MAX_REPLICAS};

#[pyclass(name = "Router", module = "pagedllm._core")]
pub(crate) struct PyRouter {
    inner: Router,
}

#[pymethods]
impl PyRouter {
    #[new]
    #[pyo3(signature = (num_replicas, block_size, policy = "cache_aware", *,
                        balance_abs_threshold = defaults::BALANCE_ABS_THRESHOLD,
                        balance_rel_threshold = defaults::BALANCE_REL_THRESHOLD,
                        load_weight = defaults::LOAD_WEIGHT,
                        token_weight = defaults::TOKEN_WEIGHT,
                        pending_ttl = defaults::PENDING_TTL,
                        affinity_weight = defaults::AFFINITY_WEIGHT,
                        divert_ratio = defaults::DIVERT_RATIO))]
    #[allow(clippy::too_many_arguments)] // one per Python keyword argument
    fn new(
        num_replicas: i64,
        block_size: i64,
        policy: &str,
        balance_abs_threshold: u32,
        balance_rel_threshold: f64,
        load_weight: f64,
        token_weight: f64,
        pending_ttl: f64,
        affinity_weight: f64,
        divert_ratio: f64,
    ) -> PyResult<Self> {
        let mut cfg = RouterConfig::new(
            non_negative("num_replicas", num_replicas)?,
            non_negative("block_size", block_size)?,
            RoutingPolicy::parse(policy)?,
        );
        cfg.balance_abs_threshold = balance_abs_threshold;
        cfg.balance_rel_threshold = balance_rel_threshold;
        cfg.load_weight = load_weight;
        cfg.token_weight = token_weight;
        cfg.pending_ttl = pending_ttl;
        cfg.affinity_weight = affinity_weight;
        cfg.divert_ratio = divert_ratio;
        Ok(Self {
            inner: Router::new(cfg)?,
        })
    }

    #[getter]
    fn num_replicas(&self) -> usize {
        self.inner.config().num_replicas
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.config().policy.as_str()
    }

    /// Picks a replica for `token_ids` (see `Router::route`): `(replica, matched_blocks,
    /// eligible_blocks, uncached_tokens, ticket)`. PagedLLMError when no live replica is left
    /// outside `excluded`.
    #[pyo3(signature = (token_ids, *, lora_id = 0, session = None, excluded = 0, now = 0.0))]
    fn route(
        &mut self,
        token_ids: Vec<i64>,
        lora_id: u64,
        session: Option<&str>,
        excluded: u64,
        now: f64,
    ) -> PyResult<(usize, usize, usize, usize, u64)> {
        let tokens = kv_args::token_ids(token_ids)?;
        let d = self.inner.route(&tokens, lora_id, session, excluded, now)?;
        Ok((
            d.replica,
            d.matched_blocks,
            d.eligible_blocks,
            d.uncached_tokens,
            d.ticket,
        ))
    }

    /// The request of `ticket` (what its `route` returned) ended (see `Router::finish`).
    fn finish(&mut self, ticket: u64) -> PyResult<()> {
        Ok(self.inner.finish(ticket)?)
    }

    fn set_alive(&mut self, replica: usize, alive: bool) -> PyResult<()> {
        Ok(self.inner.set_alive(replica, alive)?)
    }

    fn is_alive(&self, replica: usize) -> bool {
        self.inner.is_alive(replica)
    }

    fn set_load(
        &mut self,
        replica: usize,
        waiting: u32,
        running: u32,
        kv_usage: f64,
    ) -> PyResult<()> {
        Ok(self.inner.set_load(replica, waiting, running, kv_usage)?)
    }

    /// Applies batch `seq` of `replica`'s KV events (`kinds` uint8, `starts` uint32, `hashes`
    /// uint64, as `Scheduler.drain_kv_events` gives them; `media` uint8, one per record, as
    /// `kv_event_index_records` gives them, None: all on the device). Returns -1 when applied,
    /// -2 when stale (already applied), else the sequence number to replay from (batches were
    /// lost).
    #[pyo3(signature = (replica, seq, kinds, starts, hashes, media = None))]
    fn apply_events(
        &mut self,
        replica: usize,
        seq: u64,
        kinds: PyReadonlyArray1<'_, u8>,
        starts: PyReadonlyArray1<'_, u32>,
        hashes: PyReadonlyArray1<'_, u64>,
        media: Option<PyReadonlyArray1<'_, u8>>,
    ) -> PyResult<i64> {
        let r = self.inner.apply_batch_on(
            replica,
            seq,
            kinds.as_slice()?,
            starts.as_slice()?,
            hashes.as_slice()?,
            match &media {
                Some(m) => m.as_slice()?,
                None => &[],
            },
        )?;
        Ok(match r {
            Applied::Applied => -1,
            Applied::Stale => -2,
            Applied::Gap { expected } => expected as i64,
        })
    }

    /// Replaces `replica`'s part of the index with `hashes` (its cache as of batch `seq`;
    /// `media` uint8, one per hash, None: all on the device).
    #[pyo3(signature = (replica, seq, hashes, media = None))]
    fn apply_snapshot(
        &mut self,
        replica: usize,
        seq: u64,
        hashes: PyReadonlyArray1<'_, u64>,
        media: Option<PyReadonlyArray1<'_, u8>>,
    ) -> PyResult<()> {
        let media = match &media {
            Some(m) => m.as_slice()?,
            None => &[],
        };
        Ok(self
            .inner
            .apply_snapshot_on(replica, seq, hashes.as_slice()?, media)?)
    }

    /// Forgets `replica`'s part of the index (a restarted replica: batches from 0 again).
    fn reset_replica(&mut self, replica: usize) -> PyResult<()> {
        Ok(self.inner.reset_replica(replica)?)
    }

    /// Bounds `replica`'s part of the index to `blocks` (its cache's size): blocks stored past
    /// it are dropped and counted (`stats()`'s `dropped_blocks`).
    fn set_index_capacity(&mut self, replica: usize, blocks: usize) -> PyResult<()> {
        Ok(self.inner.set_index_capacity(replica, blocks)?)
    }

    fn next_seq(&self, replica: usize) -> PyResult<u64> {
        Ok(self.inner.index().next_seq(replica)?)
    }

    /// Every block hash the index says `replica` holds (uint64, in no order).
    fn replica_hashes<'py>(
        &self,
        py: Python<'py>,
        replica: usize,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        Ok(PyArray1::from_vec(
            py,
            self.inner.index().replica_hashes(replica)?,
        ))
    }

    fn expire_pending(&mut self, now: f64) {
        self.inner.expire_pending(now)
    }

    /// Blocks of the requests in flight on `replica` that count as held there at `now`.
    #[pyo3(signature = (replica, *, now = 0.0))]
    fn num_pending(&self, replica: usize, now: f64) -> usize {
        self.inner.num_pending(replica, now)
    }

    /// Per replica: routed, query_blocks, hit_blocks, in_flight, uncached_tokens, waiting,
    /// running, kv_usage, alive, indexed_blocks, index_capacity, dropped_blocks, and the blocks
    /// indexed in its offload tiers: host_tier_blocks, disk_tier_blocks.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        (0..self.inner.config().num_replicas)
            .map(|r| {
                let d = PyDict::new(py);
                let c = self.inner.counters(r).unwrap_or_default();
                let l = self.inner.load(r).unwrap_or_default();
                d.set_item("routed", c.routed)?;
                d.set_item("query_blocks", c.query_blocks)?;
                d.set_item("hit_blocks", c.hit_blocks)?;
                d.set_item("in_flight", l.in_flight)?;
                d.set_item("uncached_tokens", l.uncached_tokens)?;
                d.set_item("waiting", l.waiting)?;
                d.set_item("running", l.running)?;
                d.set_item("kv_usage", l.kv_usage)?;
                d.set_item("alive", self.inner.is_alive(r))?;
                let (held, capacity, dropped) = self.inner.index().replica_usage(r)?;
                d.set_item("indexed_blocks", held)?;
                d.set_item("index_capacity", capacity)?;
                d.set_item("dropped_blocks", dropped)?;
                let index = self.inner.index();
                d.set_item("host_tier_blocks", index.num_blocks_on(r, Medium::Host))?;
                d.set_item("disk_tier_blocks", index.num_blocks_on(r, Medium::Disk))?;
                Ok(d)
            })
            .collect()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRouter>()?;
    let names: Vec<&str> = RoutingPolicy::ALL.iter().map(|p| p.as_str()).collect();
    m.add("ROUTING_POLICIES", names)?;
    m.add("MAX_ROUTER_REPLICAS", MAX_REPLICAS)
}
