//! KV-event batches on the wire, both ways: vLLM's msgpack `KVEventBatch` written from a
//! [`KvEventBatch`](super::KvEventBatch)'s arrays ([`encode`]) and read back into arrays
//! ([`decode`]), so no other layer restates an event's kind codes or field order.
//!
//! The encoding is byte for byte what vLLM 0.32's msgspec encoder writes for the same events
//! (`vllm/distributed/kv_events.py`, `v1/core/block_pool.py`): the batch is an `array_like`
//! struct, `[ts, events, data_parallel_rank]` (msgspec writes every field of an array-like
//! struct, `omit_defaults` or not), each event a tagged struct in map form (`{"type":
//! "BlockStored", field: value, ...}`: the tag first, then the fields in declaration order,
//! those with a default left out while they hold it). vLLM's block pool sets `extra_keys` (one
//! nil per block without extras) and `group_idx` (0: one KV-cache group), so both are written.
//!
//! The decoder reads what vLLM and pagedllm publish: the batch as an array `[ts, events,
//! rank?]` or a map (`{"ts", "events"}`), each event as a map (its tag under `"type"`) or an
//! array (the tag, then the fields in declaration order, as older vLLM sent them); hashes as
//! integers or digest bytes (their low 64 bits). Events of unknown kinds are skipped; anything
//! else that is not a batch is a [`DecodeError`] naming what is wrong, never a panic.
use std::fmt;

use super::{KvEventKind, Medium};
use crate::kv::prefix_cache::ROOT_HASH;

const TAG_STORED: &str = "BlockStored";
const TAG_REMOVED: &str = "BlockRemoved";
const TAG_CLEARED: &str = "AllBlocksCleared";

/// Each known event's fields in declaration order (its array form).
const STORED_FIELDS: [&str; 8] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
];
const REMOVED_FIELDS: [&str; 2] = ["block_hashes", "medium"];

/// Nesting deeper than this is refused (a payload cannot exhaust the stack).
const MAX_DEPTH: usize = 32;

/// Why a batch cannot be encoded (arrays that do not describe records).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeError(pub String);

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EncodeError {}

/// Why a payload is not a KV-event batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Not msgpack: truncated, a reserved byte, text that is not UTF-8, bytes after the
    /// value, or nesting too deep.
    NotMsgpack(String),
    /// Msgpack, but not `[ts, events, rank]` nor `{"ts", "events"}`.
    NotABatch(String),
    /// An event, or a field of a known event, of the wrong shape or type.
    BadEvent(String),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::NotMsgpack(m) => write!(f, "not msgpack ({m})"),
            DecodeError::NotABatch(m) | DecodeError::BadEvent(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for DecodeError {}

/// The records to encode: see `KvEventBatch` (`media` empty: every record the device's).
#[derive(Debug, Clone, Copy, Default)]
pub struct Records<'a> {
    pub kinds: &'a [u8],
    pub media: &'a [u8],
    pub starts: &'a [u32],
    pub parents: &'a [u64],
    pub extra_keys: &'a [u64],
    pub hashes: &'a [u64],
    /// `block_size` per hash, or empty: no record lists tokens (a snapshot, `hashes_only`).
    pub tokens: &'a [u32],
}

impl<'a> Records<'a> {
    pub fn of(b: &'a super::KvEventBatch) -> Self {
        Records {
            kinds: &b.kinds,
            media: &b.media,
            starts: &b.starts,
            parents: &b.parents,
            extra_keys: &b.extra_keys,
            hashes: &b.hashes,
            tokens: &b.tokens,
        }
    }
}

/// How a batch is written besides its records.
#[derive(Debug, Clone, Copy, Default)]
pub struct EncodeOptions<'a> {
    pub block_size: usize,
    /// (hash key, adapter id) of each adapter in use: a stored record under that key reports
    /// the adapter's id as its `lora_id`; under another key, none.
    pub lora: &'a [(u64, u64)],
    /// The `medium` of the device cache's records (vLLM's `GPU`, whatever the device); None
    /// writes nil. The tiers' are vLLM's `CPU` and `STORAGE`.
    pub device_medium: Option<&'a str>,
    pub data_parallel_rank: Option<u64>,
}

/// The msgpack writer for vLLM's event schema (msgspec's choices: the smallest integer and
/// string forms, floats as float64).
struct Writer(Vec<u8>);

impl Writer {
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

    /// A short string (a tag, a field name, a medium: under 32 bytes, checked by the caller).
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

    fn hashes(&mut self, hashes: &[u64]) {
        self.array(hashes.len());
        hashes.iter().for_each(|&h| self.uint(h));
    }
}

/// `r`'s records as vLLM's msgpack `KVEventBatch` stamped `ts`: `[ts, [event, ...],
/// data_parallel_rank | nil]` with `{"type": "BlockStored", "block_hashes",
/// "parent_block_hash" (nil for a first block), "token_ids", "block_size", "lora_id" (nil: no
/// adapter), "medium", "lora_name" (nil), "extra_keys" (a nil per block), "group_idx" (0)}`,
/// `{"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}` and
/// `{"type": "AllBlocksCleared"}`. A tier's stored blocks list no tokens (vLLM's offload
/// connector's neither).
pub fn encode(ts: f64, r: &Records<'_>, o: &EncodeOptions<'_>) -> Result<Vec<u8>, EncodeError> {
    let n = r.kinds.len();
    let bad = |m: &str| Err(EncodeError(m.into()));
    if r.starts.len() != n + 1 || r.parents.len() != n || r.extra_keys.len() != n {
        return bad(
            "kinds, starts (one more), parents and extra_keys must describe the same records",
        );
    }
    if !(r.media.is_empty() || r.media.len() == n) {
        return bad("media must hold one medium per record (or be empty: the device's)");
    }
    let with_tokens = !r.tokens.is_empty();
    if r.starts[n] as usize != r.hashes.len()
        || (with_tokens && r.tokens.len() != r.hashes.len() * o.block_size)
    {
        return bad(
            "starts must end at len(hashes) and tokens hold block_size per hash (or be empty)",
        );
    }
    if o.device_medium.is_some_and(|m| m.len() >= 32) {
        return bad("medium must be under 32 bytes");
    }
    let mut w = Writer(Vec::with_capacity(
        32 + n * 96 + r.hashes.len() * (10 + 5 * o.block_size),
    ));
    w.array(3);
    w.float(ts);
    w.array(n);
    for i in 0..n {
        let (lo, hi) = (r.starts[i] as usize, r.starts[i + 1] as usize);
        if lo > hi || hi > r.hashes.len() {
            return bad("starts must never decrease");
        }
        let medium = match r.media.get(i) {
            None => Medium::Device,
            Some(&m) => match Medium::from_code(m) {
                Some(m) => m,
                None => return Err(EncodeError(format!("unknown medium code {m}"))),
            },
        };
        let medium_name = match medium {
            Medium::Device => o.device_medium,
            tier => Some(tier.vllm_name()),
        };
        let block_hashes = &r.hashes[lo..hi];
        match r.kinds[i] {
            k if k == KvEventKind::Stored as u8 => {
                // vLLM leaves `extra_keys` out when there is no block to list it for
                w.map(if block_hashes.is_empty() { 9 } else { 10 });
                w.str("type");
                w.str(TAG_STORED);
                w.str("block_hashes");
                w.hashes(block_hashes);
                w.str("parent_block_hash");
                match r.parents[i] {
                    ROOT_HASH => w.nil(),
                    p => w.uint(p),
                }
                let toks = if with_tokens && medium == Medium::Device {
                    &r.tokens[lo * o.block_size..hi * o.block_size]
                } else {
                    &[]
                };
                w.str("token_ids");
                w.array(toks.len());
                toks.iter().for_each(|&t| w.uint(t as u64));
                w.str("block_size");
                w.uint(o.block_size as u64);
                w.str("lora_id");
                match o.lora.iter().find(|l| l.0 == r.extra_keys[i]) {
                    Some(&(_, id)) if r.extra_keys[i] != 0 => w.uint(id),
                    _ => w.nil(),
                }
                w.str("medium");
                w.opt_str(medium_name);
                w.str("lora_name");
                w.nil();
                if !block_hashes.is_empty() {
                    w.str("extra_keys");
                    w.array(block_hashes.len());
                    block_hashes.iter().for_each(|_| w.nil());
                }
                w.str("group_idx");
                w.uint(0);
            }
            k if k == KvEventKind::Removed as u8 => {
                w.map(4);
                w.str("type");
                w.str(TAG_REMOVED);
                w.str("block_hashes");
                w.hashes(block_hashes);
                w.str("medium");
                w.opt_str(medium_name);
                w.str("group_idx");
                w.uint(0);
            }
            k if k == KvEventKind::AllCleared as u8 => {
                w.map(1);
                w.str("type");
                w.str(TAG_CLEARED);
            }
            k => return Err(EncodeError(format!("unknown event kind {k}"))),
        }
    }
    match o.data_parallel_rank {
        Some(rank) => w.uint(rank),
        None => w.nil(),
    }
    Ok(w.0)
}

/// A decoded batch, as arrays: record `r` is `kinds[r]` (a `KvEventKind` code) on
/// `media[r]` (a `Medium` code) over `hashes[starts[r]..starts[r + 1]]`; a stored record's
/// tokens are `tokens[token_starts[r]..token_starts[r + 1]]`. Events of unknown kinds are
/// left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodedBatch {
    pub ts: f64,
    pub data_parallel_rank: Option<u64>,
    pub kinds: Vec<u8>,
    pub media: Vec<u8>,
    pub starts: Vec<u32>,
    /// Digest bytes are kept as their low 64 bits (what vLLM publishes as integers).
    pub hashes: Vec<u64>,
    /// Per hash: published as an integer (false: as digest bytes).
    pub hash_is_int: Vec<bool>,
    /// Per record: the first block's parent (None: a first block, or not a stored record).
    pub parents: Vec<Option<u64>>,
    pub token_starts: Vec<u32>,
    pub tokens: Vec<u32>,
    pub block_sizes: Vec<Option<u32>>,
    pub lora_ids: Vec<Option<u64>>,
    /// Per record: the hashes cover the tokens alone (no adapter name, no extra keys).
    pub plain: Vec<bool>,
}

/// The arrays a router index applies: own hashes per record, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexRecords {
    pub kinds: Vec<u8>,
    pub media: Vec<u8>,
    pub starts: Vec<u32>,
    pub hashes: Vec<u64>,
}

impl IndexRecords {
    pub fn new() -> Self {
        IndexRecords {
            starts: vec![0],
            ..Self::default()
        }
    }

    /// Closes a record of `kind` on `medium` over the hashes pushed since the last one.
    pub fn close(&mut self, kind: u8, medium: u8) {
        self.kinds.push(kind);
        self.media.push(medium);
        self.starts.push(self.hashes.len() as u32);
    }
}

impl DecodedBatch {
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Record `r`'s hashes and whether each was an integer.
    pub fn record_hashes(&self, r: usize) -> (&[u64], &[bool]) {
        let (lo, hi) = (self.starts[r] as usize, self.starts[r + 1] as usize);
        (&self.hashes[lo..hi], &self.hash_is_int[lo..hi])
    }

    pub fn record_tokens(&self, r: usize) -> &[u32] {
        &self.tokens[self.token_starts[r] as usize..self.token_starts[r + 1] as usize]
    }

    /// The records with the hashes published as integers (this engine's own hashes; digest
    /// bytes name another engine's blocks, which only a foreign table translates).
    pub fn own_records(&self) -> IndexRecords {
        let mut out = IndexRecords::new();
        for r in 0..self.len() {
            let (hashes, is_int) = self.record_hashes(r);
            let ints = hashes.iter().zip(is_int).filter(|(_, &i)| i);
            out.hashes.extend(ints.map(|(&h, _)| h));
            out.close(self.kinds[r], self.media[r]);
        }
        out
    }
}

/// A msgpack value, borrowed from the payload.
#[derive(Debug, Clone, PartialEq)]
enum Value<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Neg(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    Ext,
}

impl<'a> Value<'a> {
    /// A map's value under string key `key` (the last one, as msgpack readers keep).
    fn get(&self, key: &str) -> Option<&Value<'a>> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .rev()
                .find(|(k, _)| *k == Value::Str(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    fn short(&self) -> String {
        let text = format!("{self:?}");
        if text.chars().count() <= 60 {
            text
        } else {
            text.chars().take(57).collect::<String>() + "..."
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| DecodeError::NotMsgpack("truncated".into()))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::NotMsgpack(format!(
                "nested deeper than {MAX_DEPTH}"
            )));
        }
        let b = self.take(1)?[0];
        Ok(match b {
            0x00..=0x7f => Value::Uint(b as u64),
            0x80..=0x8f => self.map((b & 0x0f) as usize, depth)?,
            0x90..=0x9f => self.array((b & 0x0f) as usize, depth)?,
            0xa0..=0xbf => self.str((b & 0x1f) as usize)?,
            0xc0 => Value::Nil,
            0xc1 => return Err(DecodeError::NotMsgpack("reserved byte 0xc1".into())),
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.be(1 << (b - 0xc4))? as usize;
                Value::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.be(1 << (b - 0xc7))? as usize;
                self.take(n + 1)?;
                Value::Ext
            }
            0xca => Value::Float(f32::from_bits(self.be(4)? as u32) as f64),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::Uint(self.be(1 << (b - 0xcc))?),
            0xd0..=0xd3 => {
                let n = 1usize << (b - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                let v = ((raw << shift) as i64) >> shift; // sign-extend
                if v >= 0 {
                    Value::Uint(v as u64)
                } else {
                    Value::Neg(v)
                }
            }
            0xd4..=0xd8 => {
                self.take((1usize << (b - 0xd4)) + 1)?;
                Value::Ext
            }
            0xd9..=0xdb => {
                let n = self.be(1 << (b - 0xd9))? as usize;
                self.str(n)?
            }
            0xdc | 0xdd => {
                let n = self.be(if b == 0xdc { 2 } else { 4 })? as usize;
                self.array(n, depth)?
            }
            0xde | 0xdf => {
                let n = self.be(if b == 0xde { 2 } else { 4 })? as usize;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Neg((b as i8) as i64),
        })
    }

    fn str(&mut self, n: usize) -> Result<Value<'a>, DecodeError> {
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes)
            .map(Value::Str)
            .map_err(|_| DecodeError::NotMsgpack("a string that is not UTF-8".into()))
    }

    /// `n` entries claimed: each takes a byte at least, so more than remain is a truncation
    /// (checked before allocating for them).
    fn check_room(&self, n: usize) -> Result<(), DecodeError> {
        if n > self.buf.len() - self.pos {
            return Err(DecodeError::NotMsgpack("truncated".into()));
        }
        Ok(())
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value<'a>, DecodeError> {
        self.check_room(n)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value<'a>, DecodeError> {
        self.check_room(n.saturating_mul(2))?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let k = self.value(depth + 1)?;
            entries.push((k, self.value(depth + 1)?));
        }
        Ok(Value::Map(entries))
    }
}

/// A hash as published: an integer (the low 64 bits) or digest bytes (keyed by their low 64
/// bits); None for anything else.
fn as_hash(v: &Value<'_>) -> Option<(u64, bool)> {
    match v {
        Value::Uint(h) => Some((*h, true)),
        Value::Bin(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some((tail.iter().fold(0u64, |a, &x| (a << 8) | x as u64), false))
        }
        _ => None,
    }
}

/// One event's tag and fields by name (either form).
struct Event<'v, 'a> {
    tag: &'a str,
    fields: Vec<(&'static str, &'v Value<'a>)>,
}

impl<'v, 'a> Event<'v, 'a> {
    fn parse(event: &'v Value<'a>) -> Result<Self, DecodeError> {
        let (tag, positional) = match event {
            Value::Map(_) => (event.get("type").unwrap_or(&Value::Nil), None),
            Value::Array(items) if !items.is_empty() => (&items[0], Some(&items[1..])),
            _ => {
                return Err(DecodeError::BadEvent(format!(
                    "an event is {}, not a map or an array",
                    event.short()
                )))
            }
        };
        let Value::Str(tag) = tag else {
            return Err(DecodeError::BadEvent(format!(
                "an event's type is {}, not a name",
                tag.short()
            )));
        };
        let names: &[&'static str] = match *tag {
            TAG_STORED => &STORED_FIELDS,
            TAG_REMOVED => &REMOVED_FIELDS,
            _ => &[],
        };
        let fields = match positional {
            Some(values) => names.iter().copied().zip(values.iter()).collect(),
            None => names
                .iter()
                .filter_map(|&n| event.get(n).map(|v| (n, v)))
                .collect(),
        };
        Ok(Event { tag, fields })
    }

    fn get(&self, name: &str) -> Option<&'v Value<'a>> {
        self.fields.iter().find(|f| f.0 == name).map(|f| f.1)
    }

    /// A field that is absent or nil reads as None.
    fn opt(&self, name: &str) -> Option<&'v Value<'a>> {
        self.get(name).filter(|v| **v != Value::Nil)
    }

    fn bad(&self, name: &str, v: &Value<'_>, what: &str) -> DecodeError {
        DecodeError::BadEvent(format!("{}.{name} is {}, not {what}", self.tag, v.short()))
    }
}

/// `payload` (a msgpack `KVEventBatch`) as arrays; see the module docs for what is read.
pub fn decode(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut reader = Reader {
        buf: payload,
        pos: 0,
    };
    let batch = reader.value(0)?;
    if reader.pos != payload.len() {
        return Err(DecodeError::NotMsgpack(format!(
            "{} bytes after the batch",
            payload.len() - reader.pos
        )));
    }
    let (ts, events, rank) = match &batch {
        Value::Array(items) if items.len() == 2 || items.len() == 3 => {
            (&items[0], &items[1], items.get(2))
        }
        Value::Map(_) if batch.get("events").is_some() => (
            batch.get("ts").unwrap_or(&Value::Float(0.0)),
            batch.get("events").expect("checked"),
            batch.get("data_parallel_rank"),
        ),
        _ => {
            return Err(DecodeError::NotABatch(format!(
                "the batch is {}, not [ts, events, rank]",
                batch.short()
            )))
        }
    };
    let ts = match ts {
        Value::Uint(v) => *v as f64,
        Value::Neg(v) => *v as f64,
        Value::Float(v) => *v,
        _ => {
            return Err(DecodeError::NotABatch(format!(
                "the batch's ts is {}, not a time",
                ts.short()
            )))
        }
    };
    let Value::Array(events) = events else {
        return Err(DecodeError::NotABatch(format!(
            "the batch's events are {}, not a list",
            events.short()
        )));
    };
    let mut out = DecodedBatch {
        ts,
        data_parallel_rank: match rank {
            Some(Value::Uint(r)) => Some(*r),
            _ => None,
        },
        starts: vec![0],
        token_starts: vec![0],
        ..DecodedBatch::default()
    };
    for event in events {
        let e = Event::parse(event)?;
        let kind = match e.tag {
            TAG_STORED => KvEventKind::Stored,
            TAG_REMOVED => KvEventKind::Removed,
            TAG_CLEARED => KvEventKind::AllCleared,
            _ => continue, // a kind this router does not index
        };
        if kind == KvEventKind::AllCleared {
            push_record(&mut out, kind, Medium::Device, None, None, None, true);
            continue;
        }
        let hashes = match e.get("block_hashes") {
            Some(Value::Array(hs)) => hs,
            other => {
                return Err(DecodeError::BadEvent(format!(
                    "{}.block_hashes is {}, not a list of hashes",
                    e.tag,
                    other.unwrap_or(&Value::Nil).short()
                )))
            }
        };
        let parsed: Option<Vec<(u64, bool)>> = hashes.iter().map(as_hash).collect();
        let Some(parsed) = parsed else {
            return Err(DecodeError::BadEvent(format!(
                "{}.block_hashes is {}, not a list of hashes",
                e.tag,
                Value::Array(hashes.clone()).short()
            )));
        };
        let mut names = [None, None]; // medium, lora_name
        for (slot, name) in names.iter_mut().zip(["medium", "lora_name"]) {
            match e.opt(name) {
                None => {}
                Some(Value::Str(s)) => *slot = Some(*s),
                Some(v) => return Err(e.bad(name, v, "a string")),
            }
        }
        let medium = Medium::from_vllm_name(names[0]);
        let (parent, block_size, lora_id, plain) = if kind == KvEventKind::Stored {
            stored_fields(&e, &mut out.tokens, names[1])?
        } else {
            (None, None, None, true)
        };
        for (h, is_int) in parsed {
            out.hashes.push(h);
            out.hash_is_int.push(is_int);
        }
        push_record(&mut out, kind, medium, parent, block_size, lora_id, plain);
    }
    Ok(out)
}

/// A stored event's own fields, checked; its tokens appended to `tokens`.
#[allow(clippy::type_complexity)]
fn stored_fields(
    e: &Event<'_, '_>,
    tokens: &mut Vec<u32>,
    lora_name: Option<&str>,
) -> Result<(Option<u64>, Option<u32>, Option<u64>, bool), DecodeError> {
    let parent = match e.opt("parent_block_hash") {
        None => None,
        Some(v) => Some(
            as_hash(v)
                .ok_or_else(|| e.bad("parent_block_hash", v, "a hash"))?
                .0,
        ),
    };
    match e.get("token_ids") {
        None => {}
        Some(Value::Array(ts)) => {
            let start = tokens.len();
            for t in ts {
                match t {
                    Value::Uint(t) if *t < 1 << 32 => tokens.push(*t as u32),
                    _ => {
                        tokens.truncate(start);
                        let v = Value::Array(ts.clone());
                        return Err(e.bad("token_ids", &v, "a list of token ids"));
                    }
                }
            }
        }
        Some(v) => return Err(e.bad("token_ids", v, "a list of token ids")),
    }
    let block_size = match e.opt("block_size") {
        None => None,
        Some(Value::Uint(s)) if *s > 0 && *s <= u32::MAX as u64 => Some(*s as u32),
        Some(v) => return Err(e.bad("block_size", v, "a positive integer")),
    };
    let lora_id = match e.opt("lora_id") {
        None => None,
        Some(Value::Uint(id)) => Some(*id),
        Some(v) => return Err(e.bad("lora_id", v, "an adapter id")),
    };
    let extras_plain = match e.opt("extra_keys") {
        None => true,
        Some(Value::Array(keys)) => keys.iter().all(|k| *k == Value::Nil),
        Some(v) => return Err(e.bad("extra_keys", v, "a list")),
    };
    let plain = extras_plain && lora_name.is_none_or(str::is_empty);
    Ok((parent, block_size, lora_id, plain))
}

fn push_record(
    out: &mut DecodedBatch,
    kind: KvEventKind,
    medium: Medium,
    parent: Option<u64>,
    block_size: Option<u32>,
    lora_id: Option<u64>,
    plain: bool,
) {
    out.kinds.push(kind as u8);
    out.media.push(medium as u8);
    out.starts.push(out.hashes.len() as u32);
    out.token_starts.push(out.tokens.len() as u32);
    out.parents.push(parent);
    out.block_sizes.push(block_size);
    out.lora_ids.push(lora_id);
    out.plain.push(plain);
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
