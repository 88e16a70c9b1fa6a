//! KV events across the boundary, both ways, in vLLM's msgpack schema (`kv::events::wire`):
//! - the engine's side: `KvEventStream`, whose `publish_step(scheduler)` drains a step's events
//!   (the prefix cache's and the offload tier's), encodes them and keeps what a snapshot of
//!   the replica's cache needs; `encode_kv_event_batch` encodes arrays as given;
//! - the router's side: `decode_kv_event_batch` (a batch as numpy arrays, one Python object
//!   per array, none per block or token), `kv_event_index_records` (what the router's index
//!   applies, another engine's blocks re-hashed through a `ForeignHashes` table);
//! - the kind and medium codes (`KV_EVENT_*`), for Python that builds arrays by hand.
use std::collections::HashSet;
use std::time::{SystemTime, UNIX_EPOCH};

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use super::scheduler::PyScheduler;
use crate::kv::events::wire::{self, DecodedBatch, EncodeOptions, IndexRecords, Records};
use crate::kv::events::Medium;
use crate::kv::prefix_cache::ROOT_HASH;
use crate::kv::{salted_key, KvEventBatch, KvEventKind};
use crate::router::foreign::ForeignTable;
use crate::scheduler::Scheduler;

/// `(kinds uint8 [R], starts uint32 [R+1], parents uint64 [R], extra_keys uint64 [R],
/// hashes uint64 [H], tokens uint32 [H * block_size])`; see `KvEventBatch`.
pub(crate) fn batch_tuple(py: Python<'_>, b: KvEventBatch) -> PyResult<Bound<'_, PyTuple>> {
    let starts = if b.starts.is_empty() {
        vec![0]
    } else {
        b.starts
    };
    PyTuple::new(
        py,
        [
            PyArray1::from_vec(py, b.kinds).into_any(),
            PyArray1::from_vec(py, starts).into_any(),
            PyArray1::from_vec(py, b.parents).into_any(),
            PyArray1::from_vec(py, b.extra_keys).into_any(),
            PyArray1::from_vec(py, b.hashes).into_any(),
            PyArray1::from_vec(py, b.tokens).into_any(),
        ],
    )
}

/// Turns recording on or off for the prefix cache and the offload tier (when it keeps a log).
pub(crate) fn set_recording(s: &mut Scheduler, enabled: bool) {
    let block_size = s.block_size();
    s.kv_events_mut().set_enabled(enabled, block_size);
    if let Some(log) = s.kv_connector_mut().and_then(|c| c.kv_events_mut()) {
        log.set_enabled(enabled, block_size);
    }
}

/// A step's events: the prefix cache's, then the offload tier's.
fn drain_step(s: &mut Scheduler) -> KvEventBatch {
    let mut batch = s.kv_events_mut().drain();
    if let Some(log) = s.kv_connector_mut().and_then(|c| c.kv_events_mut()) {
        batch.append(log.drain());
    }
    batch
}

/// The prefix-cache hash key of a request run with LoRA adapter `lora_id` (0: none): what the
/// scheduler salts a request's blocks with, so a router hashes prompts the way the cache does.
#[pyfunction]
#[pyo3(signature = (lora_id, extra_key = 0))]
fn lora_hash_key(lora_id: u64, extra_key: u64) -> u64 {
    salted_key(extra_key, lora_id)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn encode_err(e: wire::EncodeError) -> PyErr {
    PyValueError::new_err(e.0)
}

/// One step's events (the arrays `drain_kv_events` returns) as vLLM's msgpack `KVEventBatch`
/// (`wire::encode`), every record on the device medium named `medium`. `lora_keys` /
/// `lora_ids`: the hash key of each adapter in use (`lora_hash_key`) and its id. Empty
/// `tokens`: the stored blocks list no token ids (a snapshot, `hashes_only`).
#[pyfunction]
#[pyo3(signature = (ts, kinds, starts, parents, extra_keys, hashes, tokens, *, block_size,
                    lora_keys, lora_ids, medium = None, data_parallel_rank = None))]
#[allow(clippy::too_many_arguments)]
fn encode_kv_event_batch<'py>(
    py: Python<'py>,
    ts: f64,
    kinds: PyReadonlyArray1<'_, u8>,
    starts: PyReadonlyArray1<'_, u32>,
    parents: PyReadonlyArray1<'_, u64>,
    extra_keys: PyReadonlyArray1<'_, u64>,
    hashes: PyReadonlyArray1<'_, u64>,
    tokens: PyReadonlyArray1<'_, u32>,
    block_size: usize,
    lora_keys: Vec<u64>,
    lora_ids: Vec<u64>,
    medium: Option<&str>,
    data_parallel_rank: Option<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    if lora_keys.len() != lora_ids.len() {
        return Err(PyValueError::new_err("lora_keys and lora_ids must pair up"));
    }
    let lora: Vec<(u64, u64)> = lora_keys.into_iter().zip(lora_ids).collect();
    let records = Records {
        kinds: kinds.as_slice()?,
        media: &[],
        starts: starts.as_slice()?,
        parents: parents.as_slice()?,
        extra_keys: extra_keys.as_slice()?,
        hashes: hashes.as_slice()?,
        tokens: tokens.as_slice()?,
    };
    let options = EncodeOptions {
        block_size,
        lora: &lora,
        device_medium: medium,
        data_parallel_rank,
    };
    let bytes = wire::encode(ts, &records, &options).map_err(encode_err)?;
    Ok(PyBytes::new(py, &bytes))
}

/// The six arrays `Scheduler.drain_kv_events` returns (`batch_tuple`).
type DrainedArrays<'a> = (
    PyReadonlyArray1<'a, u8>,
    PyReadonlyArray1<'a, u32>,
    PyReadonlyArray1<'a, u64>,
    PyReadonlyArray1<'a, u64>,
    PyReadonlyArray1<'a, u64>,
    PyReadonlyArray1<'a, u32>,
);

/// The engine's side of its KV-event stream: encodes each step's events and keeps the blocks
/// they add up to per medium (a snapshot's source). The publisher numbers, buffers and sends
/// what it returns.
#[pyclass(name = "KvEventStream", module = "pagedllm._core")]
pub(crate) struct PyKvEventStream {
    block_size: usize,
    device_medium: Option<String>,
    data_parallel_rank: u64,
    hashes_only: bool,
    lora: Vec<(u64, u64)>,
    /// Per medium, the blocks the published events hold.
    live: [HashSet<u64>; 3],
}

impl PyKvEventStream {
    fn options(&self) -> EncodeOptions<'_> {
        EncodeOptions {
            block_size: self.block_size,
            lora: &self.lora,
            device_medium: self.device_medium.as_deref(),
            data_parallel_rank: Some(self.data_parallel_rank),
        }
    }

    /// `records` encoded (None when there are none), the live blocks updated.
    fn publish_records<'py>(
        &mut self,
        py: Python<'py>,
        records: Records<'_>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if records.kinds.is_empty() {
            return Ok(None);
        }
        let records = Records {
            tokens: if self.hashes_only {
                &[]
            } else {
                records.tokens
            },
            ..records
        };
        let bytes = wire::encode(now(), &records, &self.options()).map_err(encode_err)?;
        for (r, &kind) in records.kinds.iter().enumerate() {
            let medium = records.media.get(r).map_or(0, |&m| m as usize);
            let hashes =
                &records.hashes[records.starts[r] as usize..records.starts[r + 1] as usize];
            match kind {
                k if k == KvEventKind::Stored as u8 => self.live[medium].extend(hashes),
                k if k == KvEventKind::Removed as u8 => {
                    hashes.iter().for_each(|h| {
                        self.live[medium].remove(h);
                    });
                }
                // a clear: the router forgets every medium of the replica (`PrefixIndex`)
                _ => self.live.iter_mut().for_each(HashSet::clear),
            }
        }
        Ok(Some(PyBytes::new(py, &bytes)))
    }
}

#[pymethods]
impl PyKvEventStream {
    /// `medium`: the name of the device cache's medium (vLLM's `GPU`, on every platform).
    #[new]
    #[pyo3(signature = (block_size, *, medium = None, data_parallel_rank = 0, hashes_only = false))]
    fn new(
        block_size: usize,
        medium: Option<String>,
        data_parallel_rank: u64,
        hashes_only: bool,
    ) -> PyResult<Self> {
        if medium.as_ref().is_some_and(|m| m.len() >= 32) {
            return Err(PyValueError::new_err("medium must be under 32 bytes"));
        }
        Ok(Self {
            block_size,
            device_medium: medium,
            data_parallel_rank,
            hashes_only,
            lora: Vec::new(),
            live: Default::default(),
        })
    }

    /// Blocks of adapter `lora_id` report it as their `lora_id`.
    fn note_lora(&mut self, lora_id: u64) {
        if lora_id != 0 && !self.lora.iter().any(|l| l.1 == lora_id) {
            self.lora.push((salted_key(0, lora_id), lora_id));
        }
    }

    /// The scheduler's events since the last step (prefix cache, then offload tier) as one
    /// msgpack batch; None when the step changed nothing.
    fn publish_step<'py>(
        &mut self,
        py: Python<'py>,
        scheduler: &Bound<'py, PyScheduler>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let batch = drain_step(scheduler.borrow_mut().core_mut());
        self.publish_records(py, Records::of(&batch))
    }

    /// `publish_step` for arrays already drained (`Scheduler.drain_kv_events`: the device's).
    fn publish<'py>(
        &mut self,
        py: Python<'py>,
        events: DrainedArrays<'_>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let (kinds, starts, parents, extra_keys, hashes, tokens) = events;
        let records = Records {
            kinds: kinds.as_slice()?,
            media: &[],
            starts: starts.as_slice()?,
            parents: parents.as_slice()?,
            extra_keys: extra_keys.as_slice()?,
            hashes: hashes.as_slice()?,
            tokens: tokens.as_slice()?,
        };
        self.publish_records(py, records)
    }

    /// The published blocks as one batch: `AllBlocksCleared`, then a `BlockStored` of every
    /// block on the device (no tokens), and one per offload tier holding any.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut b = KvEventBatch {
            kinds: vec![KvEventKind::AllCleared as u8],
            media: vec![Medium::Device as u8],
            starts: vec![0, 0],
            parents: vec![ROOT_HASH],
            extra_keys: vec![0],
            ..KvEventBatch::default()
        };
        for medium in Medium::ALL {
            let held = &self.live[medium as usize];
            if medium != Medium::Device && held.is_empty() {
                continue;
            }
            b.hashes.extend(held);
            b.kinds.push(KvEventKind::Stored as u8);
            b.media.push(medium as u8);
            b.starts.push(b.hashes.len() as u32);
            b.parents.push(ROOT_HASH);
            b.extra_keys.push(0);
        }
        let records = Records {
            tokens: &[],
            ..Records::of(&b)
        };
        let bytes = wire::encode(now(), &records, &self.options()).map_err(encode_err)?;
        Ok(PyBytes::new(py, &bytes))
    }
}

/// One replica's table of another engine's block hashes -> this router's (`router::foreign`).
#[pyclass(name = "ForeignHashes", module = "pagedllm._core")]
pub(crate) struct PyForeignHashes {
    inner: ForeignTable,
}

#[pymethods]
impl PyForeignHashes {
    #[new]
    fn new(block_size: usize) -> PyResult<Self> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be > 0, got 0"));
        }
        Ok(Self {
            inner: ForeignTable::new(block_size),
        })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// The kept table: {foreign hash: own hash}.
    #[getter]
    fn own<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (foreign, mine) in self.inner.own() {
            d.set_item(foreign, mine)?;
        }
        Ok(d)
    }

    /// Keeps the changes of the batch last translated (the index applied it).
    fn commit(&mut self) {
        self.inner.commit()
    }

    /// Drops them (the index did not apply it).
    fn rollback(&mut self) {
        self.inner.rollback()
    }

    /// Forgets every block (the replica starts over).
    fn reset(&mut self) {
        self.inner.reset()
    }
}

/// A published hash as a table key: an integer's low 64 bits, digest bytes' low 64 bits
/// (what vLLM publishes instead with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, its default).
#[pyfunction]
fn foreign_key(block_hash: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(bytes) = block_hash.cast::<PyBytes>() {
        let b = bytes.as_bytes();
        let tail = &b[b.len().saturating_sub(8)..];
        return Ok(tail.iter().fold(0u64, |a, &x| (a << 8) | x as u64));
    }
    block_hash.call_method1("__and__", (u64::MAX,))?.extract()
}

fn decode(payload: &[u8]) -> PyResult<DecodedBatch> {
    wire::decode(payload).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A msgpack `KVEventBatch` as arrays: `{"ts", "data_parallel_rank" (None when absent),
/// "kinds" uint8 [R] (`KV_EVENT_*`), "media" uint8 [R] (indexes into `KV_EVENT_MEDIA`),
/// "starts" uint32 [R+1] (record r's hashes are `hashes[starts[r]:starts[r+1]]`), "hashes"
/// uint64 (digest bytes as their low 64 bits), "hash_is_int" bool (per hash), "parents" uint64
/// [R] (`ROOT_HASH`: none), "token_starts" uint32 [R+1], "tokens" uint32, "block_sizes" uint32
/// [R] (0: none), "lora_ids" uint64 [R] (0: none), "plain" bool [R] (no adapter name, no
/// extra keys)}`. Events of unknown kinds are left out; ValueError naming what is wrong for a
/// payload that is not a batch.
#[pyfunction]
fn decode_kv_event_batch<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let d = decode(payload)?;
    let out = PyDict::new(py);
    out.set_item("ts", d.ts)?;
    out.set_item("data_parallel_rank", d.data_parallel_rank)?;
    let parents: Vec<u64> = d.parents.iter().map(|p| p.unwrap_or(ROOT_HASH)).collect();
    let sizes: Vec<u32> = d.block_sizes.iter().map(|s| s.unwrap_or(0)).collect();
    let loras: Vec<u64> = d.lora_ids.iter().map(|l| l.unwrap_or(0)).collect();
    out.set_item("kinds", PyArray1::from_vec(py, d.kinds))?;
    out.set_item("media", PyArray1::from_vec(py, d.media))?;
    out.set_item("starts", PyArray1::from_vec(py, d.starts))?;
    out.set_item("hashes", PyArray1::from_vec(py, d.hashes))?;
    out.set_item("hash_is_int", PyArray1::from_vec(py, d.hash_is_int))?;
    out.set_item("parents", PyArray1::from_vec(py, parents))?;
    out.set_item("token_starts", PyArray1::from_vec(py, d.token_starts))?;
    out.set_item("tokens", PyArray1::from_vec(py, d.tokens))?;
    out.set_item("block_sizes", PyArray1::from_vec(py, sizes))?;
    out.set_item("lora_ids", PyArray1::from_vec(py, loras))?;
    out.set_item("plain", PyArray1::from_vec(py, d.plain))?;
    Ok(out)
}

/// What the router's index applies from a batch: `(kinds uint8, starts uint32, hashes uint64,
/// media uint8)`. Without `foreign`, the hashes published as integers (this engine's own);
/// with it (another engine's events), the blocks re-hashed into this router's hashes, the
/// table's changes staged (`commit` or `rollback` next). ValueError naming what is wrong for a
/// payload that is not a batch (nothing staged then).
#[pyfunction]
#[pyo3(signature = (payload, foreign = None))]
fn kv_event_index_records<'py>(
    py: Python<'py>,
    payload: &[u8],
    foreign: Option<&Bound<'py, PyForeignHashes>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let d = decode(payload)?;
    let r: IndexRecords = match foreign {
        Some(table) => table.borrow_mut().inner.translate(&d),
        None => d.own_records(),
    };
    PyTuple::new(
        py,
        [
            PyArray1::from_vec(py, r.kinds).into_any(),
            PyArray1::from_vec(py, r.starts).into_any(),
            PyArray1::from_vec(py, r.hashes).into_any(),
            PyArray1::from_vec(py, r.media).into_any(),
        ],
    )
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(lora_hash_key, m)?)?;
    m.add_function(wrap_pyfunction!(encode_kv_event_batch, m)?)?;
    m.add_function(wrap_pyfunction!(decode_kv_event_batch, m)?)?;
    m.add_function(wrap_pyfunction!(kv_event_index_records, m)?)?;
    m.add_function(wrap_pyfunction!(foreign_key, m)?)?;
    m.add_class::<PyKvEventStream>()?;
    m.add_class::<PyForeignHashes>()?;
    m.add("KV_EVENT_STORED", KvEventKind::Stored as u8)?;
    m.add("KV_EVENT_REMOVED", KvEventKind::Removed as u8)?;
    m.add("KV_EVENT_ALL_CLEARED", KvEventKind::AllCleared as u8)?;
    let media: Vec<&str> = Medium::ALL.iter().map(|m| m.vllm_name()).collect();
    m.add("KV_EVENT_MEDIA", PyTuple::new(m.py(), media)?)
}
