//! KV events across the boundary: a step's `KvEventBatch` as numpy arrays (one Python object
//! per array, none per block), the same batch encoded as vLLM's msgpack `KVEventBatch` (bytes
//! straight from the arrays: no Python object per block or token), and the hash key a LoRA
//! adapter's blocks are hashed under.
//!
//! The encoding is byte for byte what vLLM 0.32's msgspec encoder writes for the same events
//! (`vllm/distributed/kv_events.py`, `v1/core/block_pool.py`): the batch is an `array_like`
//! struct, `[ts, events, data_parallel_rank]` (msgspec writes every field of an array-like
//! struct, `omit_defaults` or not), each event a tagged struct in map form (`{"type":
//! "BlockStored", field: value, ...}`: the tag first, then the fields in declaration order,
//! those with a default left out while they hold it). vLLM's block pool sets `extra_keys` (one
//! nil per block without extras) and `group_idx` (0: one KV-cache group), so both are written.
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::kv::prefix_cache::ROOT_HASH;
use crate::kv::{salted_key, KvEventBatch, KvEventKind};

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

/// The prefix-cache hash key of a request run with LoRA adapter `lora_id` (0: none): what the
/// scheduler salts a request's blocks with, so a router hashes prompts the way the cache does.
#[pyfunction]
#[pyo3(signature = (lora_id, extra_key = 0))]
fn lora_hash_key(lora_id: u64, extra_key: u64) -> u64 {
    salted_key(extra_key, lora_id)
}

/// The msgpack writer for vLLM's event schema (msgspec's choices: the smallest integer and
/// string forms, floats as float64).
struct Msgpack(Vec<u8>);

impl Msgpack {
    fn array(&mut self, n: usize) {
        match n {
            0..=15 => self.0.push(0x90 | n as u8),
            16..=0xffff => {
                self.0.push(0xdc);
                self.0.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                self.0.push(0xdd);
                self.0.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
    }

    fn map(&mut self, n: usize) {
        debug_assert!(n < 16);
        self.0.push(0x80 | n as u8);
    }

    /// A struct's tag or field name as the map key, then (the caller) its value.
    fn key(&mut self, name: &str) {
        self.str(name);
    }

    fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.0.push(v as u8),
            0x80..=0xff => self.0.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    fn float(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn str(&mut self, s: &str) {
        debug_assert!(s.len() < 32);
        self.0.push(0xa0 | s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }
}

/// One step's events (the arrays `drain_kv_events` returns) as vLLM's msgpack `KVEventBatch`:
/// `[ts, [event, ...], data_parallel_rank | nil]` with `{"type": "BlockStored", "block_hashes",
/// "parent_block_hash" (nil for a first block), "token_ids", "block_size", "lora_id" (nil: no
/// adapter), "medium", "lora_name" (nil), "extra_keys" (a nil per block), "group_idx" (0)}`,
/// `{"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}` and
/// `{"type": "AllBlocksCleared"}`. `lora_keys` / `lora_ids`: the hash key of
/// each adapter in use (`lora_hash_key`) and its id; a block under another key reports no
/// adapter. Empty `tokens`: the stored blocks list no token ids (a snapshot, `hashes_only`).
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
    let (kinds, starts, parents) = (kinds.as_slice()?, starts.as_slice()?, parents.as_slice()?);
    let (extra_keys, hashes, tokens) = (
        extra_keys.as_slice()?,
        hashes.as_slice()?,
        tokens.as_slice()?,
    );
    let r = kinds.len();
    if starts.len() != r + 1 || parents.len() != r || extra_keys.len() != r {
        return Err(PyValueError::new_err(
            "kinds, starts (one more), parents and extra_keys must describe the same records",
        ));
    }
    // no tokens at all: a snapshot, whose blocks' tokens are not kept
    let with_tokens = !tokens.is_empty();
    if starts[r] as usize != hashes.len()
        || (with_tokens && tokens.len() != hashes.len() * block_size)
    {
        return Err(PyValueError::new_err(
            "starts must end at len(hashes) and tokens hold block_size per hash (or be empty)",
        ));
    }
    if lora_keys.len() != lora_ids.len() || medium.is_some_and(|m| m.len() >= 32) {
        return Err(PyValueError::new_err(
            "lora_keys and lora_ids must pair up, medium be under 32 bytes",
        ));
    }
    let mut w = Msgpack(Vec::with_capacity(
        32 + kinds.len() * 96 + hashes.len() * (10 + 5 * block_size),
    ));
    w.array(3);
    w.float(ts);
    w.array(r);
    for i in 0..r {
        let (lo, hi) = (starts[i] as usize, starts[i + 1] as usize);
        if lo > hi || hi > hashes.len() {
            return Err(PyValueError::new_err("starts must never decrease"));
        }
        let block_hashes = &hashes[lo..hi];
        match kinds[i] {
            k if k == KvEventKind::Stored as u8 => {
                // vLLM leaves `extra_keys` out when there is no block to list it for
                w.map(if block_hashes.is_empty() { 9 } else { 10 });
                w.key("type");
                w.str("BlockStored");
                w.key("block_hashes");
                w.array(block_hashes.len());
                block_hashes.iter().for_each(|&h| w.uint(h));
                w.key("parent_block_hash");
                match parents[i] {
                    ROOT_HASH => w.nil(),
                    p => w.uint(p),
                }
                let toks = if with_tokens {
                    &tokens[lo * block_size..hi * block_size]
                } else {
                    &[]
                };
                w.key("token_ids");
                w.array(toks.len());
                toks.iter().for_each(|&t| w.uint(t as u64));
                w.key("block_size");
                w.uint(block_size as u64);
                w.key("lora_id");
                match lora_keys.iter().position(|&k| k == extra_keys[i]) {
                    Some(j) if extra_keys[i] != 0 => w.uint(lora_ids[j]),
                    _ => w.nil(),
                }
                w.key("medium");
                w.opt_str(medium);
                w.key("lora_name");
                w.nil();
                if !block_hashes.is_empty() {
                    w.key("extra_keys");
                    w.array(block_hashes.len());
                    block_hashes.iter().for_each(|_| w.nil());
                }
                w.key("group_idx");
                w.uint(0);
            }
            k if k == KvEventKind::Removed as u8 => {
                w.map(4);
                w.key("type");
                w.str("BlockRemoved");
                w.key("block_hashes");
                w.array(block_hashes.len());
                block_hashes.iter().for_each(|&h| w.uint(h));
                w.key("medium");
                w.opt_str(medium);
                w.key("group_idx");
                w.uint(0);
            }
            k if k == KvEventKind::AllCleared as u8 => {
                w.map(1);
                w.key("type");
                w.str("AllBlocksCleared");
            }
            k => return Err(PyValueError::new_err(format!("unknown event kind {k}"))),
        }
    }
    match data_parallel_rank {
        Some(rank) => w.uint(rank),
        None => w.nil(),
    }
    Ok(PyBytes::new(py, &w.0))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(lora_hash_key, m)?)?;
    m.add_function(wrap_pyfunction!(encode_kv_event_batch, m)?)
}
