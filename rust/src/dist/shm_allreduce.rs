//! Sum all-reduce of the ranks on one host over one shared segment.
//!
//! Layout: a header page (the ranks' pids, an abort flag, one barrier word per rank on its own
//! cache line), then two buffers (alternating chunk by chunk), each with one slot per rank and a
//! result slot, `chunk_bytes` each. A tensor goes through in chunks of `chunk_bytes`:
//! 1. every rank copies its chunk into its slot, then all meet at a barrier;
//! 2. small chunks (`SYMMETRIC_MAX_BYTES`): every rank sums all slots itself (one barrier);
//!    larger ones: rank r sums its disjoint slice of the slots into the result slot, a second
//!    barrier, then every rank copies the result out.
//!
//! Every rank adds the slots in rank order, so all ranks get bit-identical sums. The two buffers
//! make one barrier per chunk enough: a rank writes buffer b again only after the barrier of the
//! chunk in between, which every rank reaches only when done reading buffer b.
//!
//! A barrier is one word per rank: the number of barriers it has reached. Waiting uses
//! `wait::wait_until` (spin, yield, futex) with the peers' pidfds, the abort flag and the timeout;
//! a failed wait sets the abort flag so the others fail at once instead of at their timeout.
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::segment::Segment;
use super::wait::{publish, reached, wait_until, Peers};
use super::{DistError, DistResult};

pub const MAX_RANKS: usize = 16;
const MAGIC: u64 = 0x7061_6765_645f_6172; // "paged_ar"
const HEADER_BYTES: usize = 4096;
/// Chunks up to this size are summed whole by every rank (one barrier instead of two).
pub const SYMMETRIC_MAX_BYTES: usize = 256 * 1024;
/// Slices of the distributed reduction start on cache-line boundaries (16 floats).
const SLICE_ALIGN: usize = 16;

#[repr(C, align(64))]
struct Line(AtomicU32);

#[repr(C)]
struct Header {
    magic: AtomicU64,
    world: u32,
    _pad: u32,
    chunk_bytes: u64,
    aborted: AtomicU32,
    sleepers: AtomicU32,
    pids: [AtomicU32; MAX_RANKS],
    arrived: [Line; MAX_RANKS],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// An element type the all-reduce sums.
pub trait Elem: Copy + Send + Sync + 'static {
    /// `out[i] = slots[0][i] + slots[1][i] + ...` (in slot order).
    fn sum(out: &mut [Self], slots: &[&[Self]]);
}

#[inline(always)]
fn sum_f32_body(out: &mut [f32], slots: &[&[f32]]) {
    let n = out.len();
    let (a, b) = (&slots[0][..n], &slots[1][..n]);
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = *x + *y;
    }
    for s in &slots[2..] {
        for (o, x) in out.iter_mut().zip(&s[..n]) {
            *o += *x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_f32_avx2(out: &mut [f32], slots: &[&[f32]]) {
    sum_f32_body(out, slots)
}

impl Elem for f32 {
    fn sum(out: &mut [f32], slots: &[&[f32]]) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has avx2 (checked just above).
            return unsafe { sum_f32_avx2(out, slots) };
        }
        sum_f32_body(out, slots)
    }
}

/// bfloat16 as its bits: summed in float32, rounded to nearest even once at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// bfloat16 values held as their bits in int16 (numpy has no bfloat16: torch's
    /// `t.view(torch.int16).numpy()`), viewed in place as `Bf16`.
    pub fn from_i16_bits_mut(bits: &mut [i16]) -> &mut [Bf16] {
        // SAFETY: `Bf16` is a `repr(transparent)` u16: the size and alignment of i16, and every
        // bit pattern is a valid value; the exclusive borrow moves into the returned slice.
        unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast::<Bf16>(), bits.len()) }
    }
}

#[inline(always)]
fn bf16_to_f32(x: Bf16) -> f32 {
    f32::from_bits((x.0 as u32) << 16)
}

#[inline(always)]
fn f32_to_bf16(x: f32) -> Bf16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return Bf16(((bits >> 16) as u16) | 0x0040);
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    Bf16((bits.wrapping_add(round) >> 16) as u16)
}

impl Elem for Bf16 {
    fn sum(out: &mut [Bf16], slots: &[&[Bf16]]) {
        const BLOCK: usize = 256;
        let mut acc = [0.0f32; BLOCK];
        for start in (0..out.len()).step_by(BLOCK) {
            let end = (start + BLOCK).min(out.len());
            let acc = &mut acc[..end - start];
            for (a, x) in acc.iter_mut().zip(&slots[0][start..end]) {
                *a = bf16_to_f32(*x);
            }
            for s in &slots[1..] {
                for (a, x) in acc.iter_mut().zip(&s[start..end]) {
                    *a += bf16_to_f32(*x);
                }
            }
            for (o, a) in out[start..end].iter_mut().zip(acc.iter()) {
                *o = f32_to_bf16(*a);
            }
        }
    }
}

/// One rank's handle on the group's segment.
pub struct ShmAllReduce {
    segment: Segment,
    rank: usize,
    world: usize,
    chunk_bytes: usize,
    timeout: Duration,
    /// barriers this rank has reached
    epoch: u32,
    /// the buffer the next chunk uses (0 or 1)
    buffer: usize,
    peers: Option<Peers>,
    /// set after a failure: the ranks are out of step for good
    broken: Option<DistError>,
}

impl ShmAllReduce {
    /// Rank 0: creates the group's segment (`name()` is what the other ranks attach to).
    pub fn create(world: usize, chunk_bytes: usize, timeout: Duration) -> DistResult<Self> {
        if !(2..=MAX_RANKS).contains(&world) {
            return Err(DistError::InvalidArgument(format!(
                "world size must be in 2..={MAX_RANKS}, got {world}"
            )));
        }
        if chunk_bytes == 0 || !chunk_bytes.is_multiple_of(64) {
            return Err(DistError::InvalidArgument(format!(
                "chunk_bytes must be a positive multiple of 64, got {chunk_bytes}"
            )));
        }
        let len = HEADER_BYTES + 2 * (world + 1) * chunk_bytes;
        let segment = Segment::create("pagedllm-allreduce", len)?;
        // SAFETY: the plain fields are written before any reference to the header exists, and
        // no other process has the name yet.
        unsafe {
            let h = segment.as_ptr() as *mut Header;
            (*h).world = world as u32;
            (*h).chunk_bytes = chunk_bytes as u64;
        }
        let this = Self::new(segment, 0, world, chunk_bytes, timeout);
        let header = this.header();
        header.pids[0].store(std::process::id(), Ordering::SeqCst);
        header.magic.store(MAGIC, Ordering::SeqCst);
        Ok(this)
    }

    /// Rank `rank` (1..world): maps the segment rank 0 created.
    pub fn attach(name: &str, rank: usize, timeout: Duration) -> DistResult<Self> {
        let segment = Segment::open(name)?;
        if segment.len() < HEADER_BYTES {
            return Err(DistError::InvalidArgument(format!(
                "{name} is not an all-reduce segment (too small)"
            )));
        }
        // SAFETY: at least a header's worth of mapped bytes, page-aligned.
        let header = unsafe { &*(segment.as_ptr() as *const Header) };
        if header.magic.load(Ordering::SeqCst) != MAGIC {
            return Err(DistError::InvalidArgument(format!(
                "{name} is not an all-reduce segment"
            )));
        }
        let (world, chunk_bytes) = (header.world as usize, header.chunk_bytes as usize);
        if rank == 0 || rank >= world {
            return Err(DistError::InvalidArgument(format!(
                "rank must be in 1..{world} to attach, got {rank}"
            )));
        }
        if segment.len() < HEADER_BYTES + 2 * (world + 1) * chunk_bytes {
            return Err(DistError::InvalidArgument(format!("{name} is truncated")));
        }
        header.pids[rank].store(std::process::id(), Ordering::SeqCst);
        Ok(Self::new(segment, rank, world, chunk_bytes, timeout))
    }

    fn new(segment: Segment, rank: usize, world: usize, chunk: usize, timeout: Duration) -> Self {
        ShmAllReduce {
            segment,
            rank,
            world,
            chunk_bytes: chunk,
            timeout,
            epoch: 0,
            buffer: 0,
            peers: None,
            broken: None,
        }
    }

    fn header(&self) -> &Header {
        // SAFETY: the segment starts with a header (checked at attach, written at create).
        unsafe { &*(self.segment.as_ptr() as *const Header) }
    }

    pub fn name(&self) -> &str {
        self.segment.name()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Removes the segment's name (every rank keeps its mapping). Idempotent.
    pub fn unlink(&self) -> DistResult<()> {
        self.segment.unlink()
    }

    /// Tells every rank the group is broken (their waits fail at once); so is this handle.
    pub fn abort(&mut self) {
        self.header().aborted.store(1, Ordering::SeqCst);
        for line in &self.header().arrived[..self.world] {
            super::wait::futex_wake(&line.0);
        }
        self.broken.get_or_insert(DistError::Aborted);
    }

    /// `slot` of `buffer` (slot `world` is the result slot), as elements of `T`.
    fn slot<T>(&self, buffer: usize, slot: usize) -> *mut T {
        let offset = HEADER_BYTES + (buffer * (self.world + 1) + slot) * self.chunk_bytes;
        // SAFETY: within the mapping (its length was checked against this layout).
        unsafe { self.segment.as_ptr().add(offset).cast() }
    }

    fn barrier(&mut self) -> DistResult<()> {
        self.epoch = self.epoch.wrapping_add(1);
        let epoch = self.epoch;
        // SAFETY: the header outlives this call; taken as a raw reference so `self.peers` can be
        // filled in while it is held.
        let header = unsafe { &*(self.segment.as_ptr() as *const Header) };
        publish(&header.arrived[self.rank].0, epoch, &header.sleepers);
        for other in (0..self.world).filter(|&r| r != self.rank) {
            let (timeout, rank) = (self.timeout, self.rank);
            let peers = &mut self.peers;
            let world = self.world;
            wait_until(
                &header.arrived[other].0,
                &header.sleepers,
                |seen| reached(seen, epoch),
                Some(timeout),
                || {
                    if header.aborted.load(Ordering::SeqCst) != 0 {
                        return Err(DistError::Aborted);
                    }
                    let watch = peers.get_or_insert_with(|| {
                        Peers::new(
                            (0..world)
                                .filter(|&r| r != rank)
                                .map(|r| (r, header.pids[r].load(Ordering::SeqCst))),
                        )
                    });
                    watch.check()
                },
                || format!("rank {other} did not reach the all-reduce barrier"),
            )?;
        }
        Ok(())
    }

    /// Sums `data` over the ranks, in place: every rank passes its own and gets the total.
    /// Every rank must call it with the same length, in the same order of calls.
    pub fn all_reduce<T: Elem>(&mut self, data: &mut [T]) -> DistResult<()> {
        if let Some(err) = &self.broken {
            return Err(err.clone());
        }
        let per_chunk = self.chunk_bytes / std::mem::size_of::<T>();
        for piece in data.chunks_mut(per_chunk) {
            if let Err(err) = self.reduce_chunk(piece) {
                if err != DistError::Aborted {
                    self.abort();
                }
                self.broken = Some(err.clone());
                return Err(err);
            }
        }
        Ok(())
    }

    fn reduce_chunk<T: Elem>(&mut self, piece: &mut [T]) -> DistResult<()> {
        let (buffer, n, world) = (self.buffer, piece.len(), self.world);
        self.buffer ^= 1;
        // SAFETY: slot `rank` of `buffer` holds chunk_bytes >= n elements and is written only by
        // this rank, at a time no other rank reads it (see the module's buffer argument).
        unsafe {
            std::ptr::copy_nonoverlapping(piece.as_ptr(), self.slot(buffer, self.rank), n);
        }
        self.barrier()?;
        // SAFETY: after the barrier no rank writes any slot of `buffer` until the next barrier.
        let slots: Vec<&[T]> = (0..world)
            .map(|r| unsafe { std::slice::from_raw_parts(self.slot::<T>(buffer, r), n) })
            .collect();
        if n * std::mem::size_of::<T>() <= SYMMETRIC_MAX_BYTES {
            T::sum(piece, &slots);
            return Ok(());
        }
        let per_rank = n.div_ceil(world).next_multiple_of(SLICE_ALIGN);
        let lo = (self.rank * per_rank).min(n);
        let hi = (lo + per_rank).min(n);
        let parts: Vec<&[T]> = slots.iter().map(|s| &s[lo..hi]).collect();
        // SAFETY: the result slot's [lo, hi) is written by this rank only, read after the barrier.
        let result = unsafe {
            std::slice::from_raw_parts_mut(self.slot::<T>(buffer, world).add(lo), hi - lo)
        };
        T::sum(result, &parts);
        self.barrier()?;
        // SAFETY: the whole result slot is complete after the second barrier.
        unsafe {
            std::ptr::copy_nonoverlapping(self.slot::<T>(buffer, world), piece.as_mut_ptr(), n);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: Duration = Duration::from_secs(10);

    /// Each of `world` threads all-reduces `inputs(rank)`; every rank's result.
    fn run(world: usize, chunk: usize, len: usize, rounds: usize) -> Vec<Vec<f32>> {
        let first = ShmAllReduce::create(world, chunk, T).unwrap();
        let name = first.name().to_string();
        let mut handles = vec![first];
        for r in 1..world {
            handles.push(ShmAllReduce::attach(&name, r, T).unwrap());
        }
        handles[0].unlink().unwrap();
        let threads: Vec<_> = handles
            .into_iter()
            .map(|mut h| {
                std::thread::spawn(move || {
                    let mut last = vec![];
                    for round in 0..rounds {
                        let mut data: Vec<f32> = (0..len)
                            .map(|i| (i * (h.rank() + 1) + round) as f32 * 0.5)
                            .collect();
                        h.all_reduce(&mut data).unwrap();
                        last = data;
                    }
                    last
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    fn expected(world: usize, len: usize, round: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (0..world).map(|r| (i * (r + 1) + round) as f32 * 0.5).sum())
            .collect()
    }

    #[test]
    fn two_ranks_sum_small_and_chunked_tensors() {
        // 1000 floats in 256-byte chunks: many chunks, a partial last one
        for len in [1, 17, 1000] {
            let out = run(2, 256, len, 3);
            assert_eq!(out[0], expected(2, len, 2));
            assert_eq!(out[1], out[0]);
        }
    }

    #[test]
    fn large_chunks_take_the_distributed_path_with_the_same_sums() {
        let len = SYMMETRIC_MAX_BYTES / 4 * 3 + 5; // > one symmetric chunk, not a multiple
        let out = run(3, SYMMETRIC_MAX_BYTES * 2, len, 2);
        assert_eq!(out[0], expected(3, len, 1));
        assert!(out.iter().all(|o| o == &out[0]));
    }

    #[test]
    fn bf16_sums_round_once() {
        let first = ShmAllReduce::create(2, 1024, T).unwrap();
        let mut second = ShmAllReduce::attach(first.name(), 1, T).unwrap();
        first.unlink().unwrap();
        let mut first = first;
        let t = std::thread::spawn(move || {
            let mut d = vec![f32_to_bf16(1.5); 700];
            second.all_reduce(&mut d).unwrap();
            d
        });
        let mut d = vec![f32_to_bf16(0.25); 700];
        first.all_reduce(&mut d).unwrap();
        assert_eq!(t.join().unwrap(), d);
        assert!(d.iter().all(|x| bf16_to_f32(*x) == 1.75));
    }

    #[test]
    fn a_rank_that_never_arrives_times_out_and_breaks_the_group() {
        let mut first = ShmAllReduce::create(2, 1024, Duration::from_millis(50)).unwrap();
        let _second = ShmAllReduce::attach(first.name(), 1, T).unwrap();
        first.unlink().unwrap();
        let err = first.all_reduce(&mut [1.0f32; 4]).unwrap_err();
        assert!(matches!(err, DistError::Timeout(ref m) if m.contains("rank 1")));
        assert!(first.all_reduce(&mut [1.0f32; 4]).is_err());
        assert_eq!(_second.header().aborted.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn attaching_checks_the_rank() {
        let first = ShmAllReduce::create(2, 1024, T).unwrap();
        assert!(ShmAllReduce::attach(first.name(), 2, T).is_err());
        assert!(ShmAllReduce::attach(first.name(), 0, T).is_err());
        first.unlink().unwrap();
    }

    proptest! {
        #[test]
        fn bf16_rounding_matches_nearest_even(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite() && x.abs() < 1e38);
            let b = f32_to_bf16(x);
            // the nearest bf16 (ties to even) is what a widening float64 comparison picks
            let lo = f32::from_bits(bits & 0xffff_0000);
            let hi = f32::from_bits((bits & 0xffff_0000).wrapping_add(0x1_0000));
            let (dl, dh) = ((x as f64 - lo as f64).abs(), (hi as f64 - x as f64).abs());
            let want = if dl < dh || (dl == dh && (bits >> 16) & 1 == 0) { lo } else { hi };
            prop_assert_eq!(bf16_to_f32(b).to_bits(), want.to_bits());
        }
    }
}
