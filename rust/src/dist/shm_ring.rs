//! A broadcast ring in one shared segment: one writer, N readers, `n_chunks` chunks of
//! `chunk_bytes` (vLLM's `MessageQueue` design, with counters instead of per-chunk flags).
//!
//! The writer counts the messages it has published (`written`), each reader the messages it has
//! finished with (`read[r]`). Message m lives in chunk m % n_chunks; the writer reuses a chunk
//! only when every reader is past the message in it, so a reader may use the chunk's bytes in
//! place (zero-copy) until it calls `ack`. Both sides wait through `wait::wait_until` (spin,
//! yield, futex), watching the other side's process.
//!
//! The writer is rank 0, the readers ranks 1..=n_readers.
//!
//! A message is a tag, a few integers and a list of arrays (or None), encoded in the chunk:
//! `[len u64][tag u32][n_ints u32][n_items u32][pad u32]`, the integers (i64), one `ItemDesc`
//! per item, then each item's bytes at a 64-byte aligned offset.
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::segment::Segment;
use super::wait::{publish, reached, wait_until, Peers};
use super::{DistError, DistResult};

pub const MAX_READERS: usize = 16;
pub const MAX_DIMS: usize = 4;
const MAGIC: u64 = 0x7061_6765_645f_7267; // "paged_rg"
const HEADER_BYTES: usize = 4096;
const PREFIX_BYTES: usize = 24;
const DESC_BYTES: usize = 56;
const ALIGN: usize = 64;

#[repr(C, align(64))]
struct Line(AtomicU32);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    n_readers: u32,
    n_chunks: u32,
    chunk_bytes: u64,
    sleepers: AtomicU32,
    writer_pid: AtomicU32,
    /// readers attached so far: the last one unlinks the name
    attached: AtomicU32,
    reader_pids: [AtomicU32; MAX_READERS],
    written: Line,
    read: [Line; MAX_READERS],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// An item's element type (numpy's, by code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DType {
    Bool = 1,
    U8 = 2,
    I16 = 3,
    I32 = 4,
    I64 = 5,
    F32 = 6,
    F64 = 7,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 => 1,
            DType::I16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    fn from_code(code: u8) -> Option<DType> {
        [
            DType::Bool,
            DType::U8,
            DType::I16,
            DType::I32,
            DType::I64,
            DType::F32,
            DType::F64,
        ]
        .into_iter()
        .find(|d| *d as u8 == code)
    }
}

/// An element type a ring item may have: plain bytes, no padding, 1 to 8 bytes (so a 64-byte
/// aligned offset is aligned for it).
pub trait RingElem: Copy + 'static {
    const DTYPE: DType;
}

impl RingElem for bool {
    const DTYPE: DType = DType::Bool;
}
impl RingElem for u8 {
    const DTYPE: DType = DType::U8;
}
impl RingElem for i16 {
    const DTYPE: DType = DType::I16;
}
impl RingElem for i32 {
    const DTYPE: DType = DType::I32;
}
impl RingElem for i64 {
    const DTYPE: DType = DType::I64;
}
impl RingElem for f32 {
    const DTYPE: DType = DType::F32;
}
impl RingElem for f64 {
    const DTYPE: DType = DType::F64;
}

/// An array to send: its type, shape and C-contiguous bytes.
pub struct ItemRef<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl<'a> ItemRef<'a> {
    /// The array of `shape` whose elements, in C order, are `data`.
    pub fn of<T: RingElem>(shape: &'a [usize], data: &'a [T]) -> ItemRef<'a> {
        // SAFETY: a `RingElem` has no padding bytes, so the slice's memory is exactly
        // `size_of_val(data)` initialised bytes, borrowed for 'a as `data` is.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        ItemRef {
            dtype: T::DTYPE,
            shape,
            bytes,
        }
    }
}

/// An array received: where its bytes are in the chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ItemView {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub nbytes: usize,
}

/// A message received: its tag, integers and arrays (offsets into `chunk`).
#[derive(Debug, PartialEq, Eq)]
pub struct Message {
    pub tag: u32,
    pub ints: Vec<i64>,
    pub items: Vec<Option<ItemView>>,
    /// the chunk's first byte (valid until `Reader::ack`)
    pub chunk: *const u8,
}

// SAFETY: `chunk` only addresses the reader's shared mapping, which any thread may read; a
// message carries no thread-bound state.
unsafe impl Send for Message {}

fn align(n: usize) -> usize {
    n.next_multiple_of(ALIGN)
}

/// Bytes a message takes in a chunk.
pub fn encoded_len(ints: &[i64], items: &[Option<ItemRef<'_>>]) -> usize {
    let mut len = align(PREFIX_BYTES + 8 * ints.len() + DESC_BYTES * items.len());
    for item in items.iter().flatten() {
        len = align(len + item.bytes.len());
    }
    len
}

/// Writes the message into `chunk` (at least `encoded_len` bytes).
fn encode(chunk: &mut [u8], tag: u32, ints: &[i64], items: &[Option<ItemRef<'_>>]) {
    let len = encoded_len(ints, items);
    chunk[0..8].copy_from_slice(&(len as u64).to_le_bytes());
    chunk[8..12].copy_from_slice(&tag.to_le_bytes());
    chunk[12..16].copy_from_slice(&(ints.len() as u32).to_le_bytes());
    chunk[16..20].copy_from_slice(&(items.len() as u32).to_le_bytes());
    let mut at = PREFIX_BYTES;
    for v in ints {
        chunk[at..at + 8].copy_from_slice(&v.to_le_bytes());
        at += 8;
    }
    let mut data = align(at + DESC_BYTES * items.len());
    for item in items {
        let desc = &mut chunk[at..at + DESC_BYTES];
        desc.fill(0);
        if let Some(item) = item {
            desc[0] = item.dtype as u8;
            desc[1] = item.shape.len() as u8;
            for (d, n) in item.shape.iter().enumerate() {
                desc[8 + 8 * d..16 + 8 * d].copy_from_slice(&(*n as u64).to_le_bytes());
            }
            desc[40..48].copy_from_slice(&(data as u64).to_le_bytes());
            desc[48..56].copy_from_slice(&(item.bytes.len() as u64).to_le_bytes());
            chunk[data..data + item.bytes.len()].copy_from_slice(item.bytes);
            data = align(data + item.bytes.len());
        }
        at += DESC_BYTES;
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Reads the message a writer encoded into `chunk`.
fn decode(chunk: &[u8]) -> DistResult<Message> {
    let corrupt = || DistError::InvalidArgument("corrupt ring message".to_string());
    let len = u64_at(chunk, 0) as usize;
    if len > chunk.len() {
        return Err(corrupt());
    }
    let (tag, n_ints, n_items) = (
        u32_at(chunk, 8),
        u32_at(chunk, 12) as usize,
        u32_at(chunk, 16) as usize,
    );
    if PREFIX_BYTES + 8 * n_ints + DESC_BYTES * n_items > len {
        return Err(corrupt());
    }
    let ints = (0..n_ints)
        .map(|i| u64_at(chunk, PREFIX_BYTES + 8 * i) as i64)
        .collect();
    let descs = PREFIX_BYTES + 8 * n_ints;
    let mut items = Vec::with_capacity(n_items);
    for i in 0..n_items {
        let desc = &chunk[descs + DESC_BYTES * i..descs + DESC_BYTES * (i + 1)];
        if desc[0] == 0 {
            items.push(None);
            continue;
        }
        let dtype = DType::from_code(desc[0]).ok_or_else(corrupt)?;
        let ndim = desc[1] as usize;
        if ndim > MAX_DIMS {
            return Err(corrupt());
        }
        let shape: Vec<usize> = (0..ndim)
            .map(|d| u64_at(desc, 8 + 8 * d) as usize)
            .collect();
        let (offset, nbytes) = (u64_at(desc, 40) as usize, u64_at(desc, 48) as usize);
        if offset + nbytes > len || shape.iter().product::<usize>() * dtype.size() != nbytes {
            return Err(corrupt());
        }
        items.push(Some(ItemView {
            dtype,
            shape,
            offset,
            nbytes,
        }));
    }
    Ok(Message {
        tag,
        ints,
        items,
        chunk: chunk.as_ptr(),
    })
}

fn header_of(segment: &Segment) -> &Header {
    // SAFETY: the segment starts with a header (written at create, checked at attach).
    unsafe { &*(segment.as_ptr() as *const Header) }
}

fn chunk_of(segment: &Segment, index: usize, chunk_bytes: usize) -> *mut u8 {
    // SAFETY: within the mapping (its length was checked against the layout).
    unsafe { segment.as_ptr().add(HEADER_BYTES + index * chunk_bytes) }
}

/// The writer's end (the engine's rank 0).
pub struct Writer {
    segment: Segment,
    n_readers: usize,
    n_chunks: usize,
    chunk_bytes: usize,
    /// messages published
    next: u32,
    peers: Option<Peers>,
}

impl Writer {
    pub fn create(n_readers: usize, n_chunks: usize, chunk_bytes: usize) -> DistResult<Writer> {
        if !(1..=MAX_READERS).contains(&n_readers) {
            return Err(DistError::InvalidArgument(format!(
                "n_readers must be in 1..={MAX_READERS}, got {n_readers}"
            )));
        }
        if n_chunks == 0 || chunk_bytes < 1024 || !chunk_bytes.is_multiple_of(ALIGN) {
            return Err(DistError::InvalidArgument(format!(
                "need n_chunks >= 1 and chunk_bytes a multiple of {ALIGN} >= 1024, got \
                 {n_chunks} and {chunk_bytes}"
            )));
        }
        let segment = Segment::create("pagedllm-ring", HEADER_BYTES + n_chunks * chunk_bytes)?;
        // SAFETY: no other process has the name yet.
        unsafe {
            let h = segment.as_ptr() as *mut Header;
            (*h).n_readers = n_readers as u32;
            (*h).n_chunks = n_chunks as u32;
            (*h).chunk_bytes = chunk_bytes as u64;
        }
        let header = header_of(&segment);
        header
            .writer_pid
            .store(std::process::id(), Ordering::SeqCst);
        header.magic.store(MAGIC, Ordering::SeqCst);
        Ok(Writer {
            segment,
            n_readers,
            n_chunks,
            chunk_bytes,
            next: 0,
            peers: None,
        })
    }

    pub fn name(&self) -> &str {
        self.segment.name()
    }

    pub fn unlink(&self) -> DistResult<()> {
        self.segment.unlink()
    }

    /// The largest message (`encoded_len`) one chunk holds.
    pub fn capacity(&self) -> usize {
        self.chunk_bytes
    }

    /// Publishes a message to every reader, waiting (at most `timeout`) for a free chunk.
    /// `Ok(false)`: the message is larger than a chunk (nothing was sent).
    pub fn publish(
        &mut self,
        tag: u32,
        ints: &[i64],
        items: &[Option<ItemRef<'_>>],
        timeout: Option<Duration>,
    ) -> DistResult<bool> {
        if items.iter().flatten().any(|i| {
            i.shape.len() > MAX_DIMS
                || i.shape.iter().product::<usize>() * i.dtype.size() != i.bytes.len()
        }) {
            return Err(DistError::InvalidArgument(format!(
                "an array's shape must have at most {MAX_DIMS} dimensions and match its bytes"
            )));
        }
        if encoded_len(ints, items) > self.chunk_bytes {
            return Ok(false);
        }
        let m = self.next;
        let header = header_of(&self.segment);
        // chunk m % n_chunks is free once every reader is past message m - n_chunks
        let free_from = m.wrapping_sub(self.n_chunks as u32).wrapping_add(1);
        for r in 0..self.n_readers {
            let peers = &mut self.peers;
            let n_readers = self.n_readers;
            wait_until(
                &header.read[r].0,
                &header.sleepers,
                |seen| reached(seen, free_from),
                timeout,
                || {
                    let known = peers.as_ref().map_or(0, Peers::len);
                    if known < n_readers {
                        *peers =
                            Some(Peers::new((0..n_readers).map(|r| {
                                (r + 1, header.reader_pids[r].load(Ordering::SeqCst))
                            })));
                    }
                    peers.as_ref().map_or(Ok(()), Peers::check)
                },
                || format!("rank {} did not free a ring chunk", r + 1),
            )?;
        }
        let index = m as usize % self.n_chunks;
        // SAFETY: every reader is past the chunk's previous message: only this writer touches it.
        let chunk = unsafe {
            std::slice::from_raw_parts_mut(
                chunk_of(&self.segment, index, self.chunk_bytes),
                self.chunk_bytes,
            )
        };
        encode(chunk, tag, ints, items);
        self.next = m.wrapping_add(1);
        publish(&header.written.0, self.next, &header.sleepers);
        Ok(true)
    }
}

/// A reader's end (a worker).
pub struct Reader {
    /// shared with the arrays viewing a received chunk (`ring_numpy`), so the mapping outlives
    /// them
    segment: Arc<Segment>,
    reader: usize,
    n_chunks: usize,
    chunk_bytes: usize,
    /// messages finished with
    next: u32,
    /// a message received and not yet acknowledged
    holding: bool,
    peers: Peers,
}

impl Reader {
    /// Attaches the reader of rank `rank` (1..=n_readers) to the ring `name`; the last reader
    /// to attach unlinks the name.
    pub fn attach(name: &str, rank: usize) -> DistResult<Reader> {
        let segment = Segment::open(name)?;
        if segment.len() < HEADER_BYTES || header_of(&segment).magic.load(Ordering::SeqCst) != MAGIC
        {
            return Err(DistError::InvalidArgument(format!(
                "{name} is not a ring segment"
            )));
        }
        let header = header_of(&segment);
        let (n_readers, n_chunks, chunk_bytes) = (
            header.n_readers as usize,
            header.n_chunks as usize,
            header.chunk_bytes as usize,
        );
        if !(1..=n_readers).contains(&rank) {
            return Err(DistError::InvalidArgument(format!(
                "a reader's rank must be in 1..={n_readers}, got {rank}"
            )));
        }
        let reader = rank - 1;
        if segment.len() < HEADER_BYTES + n_chunks * chunk_bytes {
            return Err(DistError::InvalidArgument(format!("{name} is truncated")));
        }
        header.reader_pids[reader].store(std::process::id(), Ordering::SeqCst);
        if header.attached.fetch_add(1, Ordering::SeqCst) + 1 == n_readers as u32 {
            // every reader has it mapped: the name can go (nothing left in /dev/shm even if
            // every process is killed from here on)
            segment.unlink()?;
        }
        let peers = Peers::new([(0, header.writer_pid.load(Ordering::SeqCst))]);
        let next = header.read[reader].0.load(Ordering::SeqCst);
        Ok(Reader {
            segment: Arc::new(segment),
            reader,
            n_chunks,
            chunk_bytes,
            next,
            holding: false,
            peers,
        })
    }

    /// The next message (waiting at most `timeout`; None when it passes). Its bytes stay valid
    /// until `ack`; receiving again before `ack` acknowledges the previous message first.
    pub fn receive(&mut self, timeout: Option<Duration>) -> DistResult<Option<Message>> {
        if self.holding {
            self.ack();
        }
        let header = header_of(&self.segment);
        let want = self.next.wrapping_add(1);
        let peers = &self.peers;
        let waited = wait_until(
            &header.written.0,
            &header.sleepers,
            |seen| reached(seen, want),
            timeout,
            || peers.check(),
            || "no message arrived".to_string(),
        );
        match waited {
            Err(DistError::Timeout(_)) => return Ok(None),
            Err(err) => return Err(err),
            Ok(()) => {}
        }
        let index = self.next as usize % self.n_chunks;
        // SAFETY: the writer published message `next` into this chunk and does not touch it
        // until this reader acknowledges it.
        let chunk = unsafe {
            std::slice::from_raw_parts(
                chunk_of(&self.segment, index, self.chunk_bytes),
                self.chunk_bytes,
            )
        };
        self.holding = true;
        decode(chunk).map(Some)
    }

    /// The ring's mapping, which a received message's chunk lies in.
    pub fn mapping(&self) -> &Arc<Segment> {
        &self.segment
    }

    /// Done with the last message received: its chunk may be reused.
    pub fn ack(&mut self) {
        if !self.holding {
            return;
        }
        self.holding = false;
        self.next = self.next.wrapping_add(1);
        let header = header_of(&self.segment);
        publish(&header.read[self.reader].0, self.next, &header.sleepers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of(v: &[i64]) -> &[u8] {
        // SAFETY: i64 has no padding; the slice covers exactly the values.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
    }

    fn read_i64(msg: &Message, item: &ItemView) -> Vec<i64> {
        // SAFETY: the chunk is valid until ack; offsets are 64-byte aligned.
        unsafe {
            std::slice::from_raw_parts(msg.chunk.add(item.offset) as *const i64, item.nbytes / 8)
                .to_vec()
        }
    }

    #[test]
    fn every_reader_gets_every_message_in_order_through_a_small_ring() {
        let mut writer = Writer::create(2, 2, 1024).unwrap();
        let name = writer.name().to_string();
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let mut reader = Reader::attach(&name, r + 1).unwrap();
                std::thread::spawn(move || {
                    let mut got = vec![];
                    for _ in 0..50 {
                        let msg = reader
                            .receive(Some(Duration::from_secs(10)))
                            .unwrap()
                            .unwrap();
                        let item = msg.items[1].clone().unwrap();
                        assert!(msg.items[0].is_none());
                        got.push((msg.tag, msg.ints.clone(), read_i64(&msg, &item), item.shape));
                        reader.ack();
                    }
                    got
                })
            })
            .collect();
        writer.unlink().unwrap();
        for m in 0..50i64 {
            let values: Vec<i64> = (0..m % 7).map(|i| i * m).collect();
            let shape = [values.len()];
            let item = ItemRef {
                dtype: DType::I64,
                shape: &shape,
                bytes: bytes_of(&values),
            };
            let sent = writer
                .publish(
                    m as u32,
                    &[m, -m],
                    &[None, Some(item)],
                    Some(Duration::from_secs(10)),
                )
                .unwrap();
            assert!(sent);
        }
        for reader in readers {
            let got = reader.join().unwrap();
            for (m, (tag, ints, values, shape)) in got.into_iter().enumerate() {
                let m = m as i64;
                assert_eq!((tag, ints), (m as u32, vec![m, -m]));
                assert_eq!(values, (0..m % 7).map(|i| i * m).collect::<Vec<_>>());
                assert_eq!(shape, vec![(m % 7) as usize]);
            }
        }
    }

    #[test]
    fn the_last_reader_to_attach_unlinks_the_name() {
        let writer = Writer::create(2, 2, 1024).unwrap();
        let path = format!("/dev/shm{}", writer.name());
        let _first = Reader::attach(writer.name(), 1).unwrap();
        assert!(std::path::Path::new(&path).exists());
        let _second = Reader::attach(writer.name(), 2).unwrap();
        assert!(!std::path::Path::new(&path).exists());
    }

    #[test]
    fn a_message_larger_than_a_chunk_is_not_sent() {
        let mut writer = Writer::create(1, 2, 1024).unwrap();
        writer.unlink().unwrap();
        let values = vec![0i64; 200];
        let item = ItemRef {
            dtype: DType::I64,
            shape: &[200],
            bytes: bytes_of(&values),
        };
        assert!(!writer.publish(0, &[], &[Some(item)], None).unwrap());
    }

    #[test]
    fn a_full_ring_times_out_naming_the_slow_reader() {
        let mut writer = Writer::create(1, 1, 1024).unwrap();
        let _reader = Reader::attach(writer.name(), 1).unwrap();
        writer.unlink().unwrap();
        let short = Some(Duration::from_millis(30));
        assert!(writer.publish(0, &[], &[], short).unwrap());
        let err = writer.publish(1, &[], &[], short).unwrap_err();
        assert!(matches!(err, DistError::Timeout(ref m) if m.contains("rank 1")));
    }

    #[test]
    fn a_reader_with_nothing_to_read_gets_none_after_its_timeout() {
        let writer = Writer::create(1, 2, 1024).unwrap();
        let mut reader = Reader::attach(writer.name(), 1).unwrap();
        writer.unlink().unwrap();
        assert_eq!(
            reader.receive(Some(Duration::from_millis(20))).unwrap(),
            None
        );
    }

    #[test]
    fn a_mismatched_shape_is_refused() {
        let mut writer = Writer::create(1, 2, 1024).unwrap();
        writer.unlink().unwrap();
        let item = ItemRef {
            dtype: DType::I64,
            shape: &[3],
            bytes: &[0u8; 16],
        };
        assert!(matches!(
            writer.publish(0, &[], &[Some(item)], None),
            Err(DistError::InvalidArgument(_))
        ));
    }
}
