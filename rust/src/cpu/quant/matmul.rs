//! `quant_linear`: `y [M, N] = x [M, K] · W^T + b` over a weight in ggml block formats.
use std::cell::RefCell;
use std::ops::Range;

use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

use super::{dequantize_range, fast, QuantMatrix};
use super::{gemm16, int16, int8};
use crate::cpu::linear::{linear, PANEL};
use crate::cpu::{invalid, pool, simd};
use crate::error::Result;

/// Up to this many rows of x the product is memory-bound: each weight row is dequantized a
/// chunk at a time into L1 and dotted with every row of x there (`decode_rows`); above it the
/// rows are dequantized once into panels that every row of x passes over (`prefill_rows`).
pub const DECODE_MAX_ROWS: usize = 8;
/// Elements of a weight row dequantized at a time on the decode path (1 KiB: whole blocks of
/// every type, and a K-quant super-block).
const CHUNK: usize = 256;
/// Bytes of f32 panels a thread dequantizes at a time on the prefill path: `linear` packs x
/// once per call and keeps each K slice of a panel in L1 while an L2 block of x passes over
/// it, so the panels may sit in L3; more of them a call spreads the packing of x thinner.
const PANEL_SCRATCH_BYTES: usize = 2048 * 1024;
/// Below this many weight elements a share, a worker thread costs more than it saves.
const MIN_SHARE_ELEMS: usize = 1 << 16;
/// Runs of rows a call is cut into per thread, claimed by whichever thread is free.
const CHUNKS_PER_THREAD: usize = 4;

/// Decode runs are cut into whole passes of this many weight rows (`vnni4`'s).
#[cfg(target_arch = "x86_64")]
const PASS_ROWS: usize = super::vnni4::ROWS;
#[cfg(not(target_arch = "x86_64"))]
const PASS_ROWS: usize = 1;

/// How `quant_linear_with` multiplies the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// As f32: the weights dequantized (exact up to f32 summation).
    F32,
    /// Up to `DECODE_MAX_ROWS` rows of x, rows of the 32-element block types by x quantized to
    /// 8 bits per 32 elements and integer dot products (`int8`); the rest as `F32`.
    Int8,
    /// Up to `DECODE_MAX_ROWS` rows of x, rows of every quantized type by x quantized to 16
    /// bits per 32 elements and integer dot products (`int16`); more rows of x by weights all
    /// of quantized types on integer panels (`gemm16`), the same codes of x; the rest as `F32`.
    Int16,
}

/// x quantized once per call for the integer products (`Activations::Int8` / `Int16` at
/// decode row counts).
enum QuantizedX {
    Int8(int8::QuantizedRows),
    /// The 16-bit codes, and at decode rows on AVX-512 with VNNI their byte planes.
    Int16(int16::QuantizedRows, Option<Box<Planes>>),
}

/// x's 16-bit codes split for the VNNI products (`vnni::Planes`; none off x86-64).
#[cfg(target_arch = "x86_64")]
type Planes = super::vnni::Planes;
#[cfg(not(target_arch = "x86_64"))]
type Planes = std::convert::Infallible;

/// x's 16-bit codes `q` (`m` rows) split for the VNNI products, where the process takes them
/// and some segment of `w` is decoded on them (Q8_0's rows stay on the AVX2 units: no planes
/// for an all-Q8_0 weight).
fn planes(q: &int16::QuantizedRows, m: usize, w: &QuantMatrix<'_>) -> Option<Planes> {
    #[cfg(target_arch = "x86_64")]
    if super::vnni()
        && w.segments
            .iter()
            .any(|s| int16::takes(s.qtype) && super::vnni::decodes(s.qtype))
    {
        let types: Vec<_> = w.segments.iter().map(|s| s.qtype).collect();
        return Some(Planes::new(q, m, w.k(), &types));
    }
    let _ = (q, m, w);
    None
}

impl QuantizedX {
    /// x `[m, k]` quantized once per call as `activations` asks, for the path its `m` rows
    /// take: up to `DECODE_MAX_ROWS`, where some row of `w` takes the integer products
    /// (`int8` / `int16`); above, 16-bit codes for the integer panels where every row's type
    /// takes them (`gemm16`); otherwise None (the f32 path).
    fn new(
        x: &[f32],
        m: usize,
        w: &QuantMatrix<'_>,
        activations: Activations,
        fast: bool,
    ) -> Option<Self> {
        let k = w.k();
        if !k.is_multiple_of(32) {
            return None;
        }
        // repacked rows are read as their plain type by every path but the VNNI products
        let read_as = |s: &super::Segment<'_>| super::repack::read_as(s.qtype);
        let any = |takes: fn(super::QType) -> bool| w.segments.iter().any(|s| takes(read_as(s)));
        let codes = || int16::QuantizedRows::new(x, k, fast);
        if m > DECODE_MAX_ROWS {
            let all = w.segments.iter().all(|s| gemm16::takes(read_as(s)));
            return (activations == Activations::Int16 && all).then(|| Self::Int16(codes(), None));
        }
        match activations {
            Activations::F32 => None,
            Activations::Int8 => {
                any(int8::takes).then(|| Self::Int8(int8::QuantizedRows::new(x, k, fast)))
            }
            Activations::Int16 => any(int16::takes).then(|| {
                let q = codes();
                let p = planes(&q, m, w).map(Box::new);
                Self::Int16(q, p)
            }),
        }
    }

    /// Whether rows of type `t` take the integer products.
    fn takes(&self, t: super::QType) -> bool {
        match self {
            Self::Int8(_) => int8::takes(t),
            Self::Int16(..) => int16::takes(t),
        }
    }
}

/// `out [M, N] = x [M, K] · W^T + bias` for the weight `w [N, K]`; x and out contiguous.
/// `num_threads` threads at most (the caller and parked workers of the kernels' pool), each
/// taking runs of output rows (columns of out).
pub fn quant_linear(
    x: ArrayView2<f32>,
    w: &QuantMatrix<'_>,
    bias: Option<&[f32]>,
    out: ArrayViewMut2<f32>,
    num_threads: usize,
) -> Result<()> {
    quant_linear_with(x, w, bias, out, num_threads, Activations::F32)
}

/// `quant_linear`, the activations multiplied as `activations` says.
pub fn quant_linear_with(
    x: ArrayView2<f32>,
    w: &QuantMatrix<'_>,
    bias: Option<&[f32]>,
    mut out: ArrayViewMut2<f32>,
    num_threads: usize,
    activations: Activations,
) -> Result<()> {
    let (m, k) = x.dim();
    let n = w.n();
    if k != w.k() {
        return Err(invalid(format!(
            "x has {k} columns, the weight's rows have {} elements",
            w.k()
        )));
    }
    if out.dim() != (m, n) {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{m}, {n}] (x's rows, the weight's rows)",
            out.shape()
        )));
    }
    if let Some(b) = bias {
        if b.len() != n {
            return Err(invalid(format!(
                "bias has {} elements, expected {n}",
                b.len()
            )));
        }
    }
    let x = x
        .to_slice()
        .ok_or_else(|| invalid("x must be contiguous"))?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let fast = fast();
    // quantized once per call, read by every share
    let xq = QuantizedX::new(x, m, w, activations, fast);
    // the decode path's AVX2 row dots of f32 activations (`fused_row`) add each sub-block's
    // min times these sums once: made only where some segment's rows take that path (with
    // 16-bit activations none: summing x showed in an 8-stream step's profile)
    let plain_rows = w.segments.iter().any(|s| {
        let t = super::repack::read_as(s.qtype);
        xq.as_ref().is_none_or(|xq| !xq.takes(t))
    });
    let xsum: Vec<f32> = if fast && plain_rows && m <= DECODE_MAX_ROWS && k % 32 == 0 {
        x.chunks_exact(32).map(|c| c.iter().sum()).collect()
    } else {
        Vec::new()
    };
    let ctx = Ctx {
        x,
        xq: xq.as_ref(),
        xsum: &xsum,
        w,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        m,
        k,
        n,
        fast,
    };
    if m <= DECODE_MAX_ROWS {
        let per_share = (MIN_SHARE_ELEMS / k).max(1);
        let threads = num_threads.clamp(1, n.div_ceil(per_share));
        let chunk = n
            .div_ceil(threads * CHUNKS_PER_THREAD)
            .max(per_share)
            .next_multiple_of(PASS_ROWS);
        run_runs(threads, n, chunk, |rows| decode_rows(&ctx, rows));
    } else {
        let chunk = if xq.is_some() {
            // the integer panels keep one panel at a time: runs as small as the decode path's
            // (a 576-row weight in one run left the second thread idle)
            n.div_ceil(num_threads.max(1) * CHUNKS_PER_THREAD)
                .next_multiple_of(PANEL)
        } else {
            (PANEL_SCRATCH_BYTES / (4 * k) / PANEL).max(1) * PANEL
        };
        let threads = num_threads.clamp(1, n.div_ceil(chunk));
        run_runs(threads, n, chunk, |rows| prefill_rows(&ctx, rows));
    }
    Ok(())
}

/// `task` over `0..n` cut into runs of `chunk`, claimed by `threads` threads.
fn run_runs(threads: usize, n: usize, chunk: usize, task: impl Fn(Range<usize>) + Sync) {
    let runs = n.div_ceil(chunk);
    if threads == 1 {
        task(0..n);
        return;
    }
    pool::WORKERS.run_claimed(threads, runs, |c| task(c * chunk..((c + 1) * chunk).min(n)));
}

/// `out`'s first element; the shares write disjoint columns of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: each share writes only the columns of its own rows of the weight, and `quant_linear`
// holds the exclusive borrow of `out` until every share has returned.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

struct Ctx<'a, 'w> {
    /// `[m, k]`.
    x: &'a [f32],
    /// x quantized for the integer products, or None.
    xq: Option<&'a QuantizedX>,
    /// `[m, k / 32]`: the sums of x's 32-element runs (decode rows on the AVX2 path), or empty.
    xsum: &'a [f32],
    w: &'a QuantMatrix<'w>,
    bias: Option<&'a [f32]>,
    out: OutPtr,
    m: usize,
    k: usize,
    n: usize,
    /// Take the AVX2 paths (`super::fast`).
    fast: bool,
}

impl Ctx<'_, '_> {
    /// Writes `value` (plus the bias) to `out[row, col]`.
    #[inline(always)]
    fn put(&self, row: usize, col: usize, value: f32) {
        let b = self.bias.map_or(0.0, |b| b[col]);
        // SAFETY: row < m and col < n: inside out `[m, n]`; no other share writes column
        // `col` (OutPtr).
        unsafe { *self.out.0.add(row * self.n + col) = value + b };
    }
}

fn decode_rows(ctx: &Ctx<'_, '_>, rows: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if ctx.fast {
        // SAFETY: `fast` is set only on a CPU with avx2, fma and f16c.
        unsafe { decode_rows_avx2(ctx, rows) };
        return;
    }
    decode_rows_with::<false>(ctx, rows);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_rows_avx2(ctx: &Ctx<'_, '_>, rows: Range<usize>) {
    decode_rows_with::<true>(ctx, rows);
}

/// Each weight row of `rows`, `CHUNK` elements at a time, dequantized into a buffer that stays
/// in L1 and dotted with the same elements of every row of x: the weight is read once.
#[inline(always)]
fn decode_rows_with<const F: bool>(ctx: &Ctx<'_, '_>, rows: Range<usize>) {
    let m = ctx.m;
    let mut rs = RowScratch {
        buf: [0.0f32; CHUNK],
        sums: [0.0f32; DECODE_MAX_ROWS],
        x8: Vec::new(),
        x16: Vec::new(),
        #[cfg(target_arch = "x86_64")]
        planes: Vec::new(),
        plain: Vec::new(),
    };
    // x's quantized rows looked up once per run, not once per weight row
    match ctx.xq {
        Some(QuantizedX::Int8(xq)) => rs.x8.extend((0..m).map(|i| xq.row(i))),
        Some(QuantizedX::Int16(xq, p)) => {
            rs.x16.extend((0..m).map(|i| xq.row(i)));
            #[cfg(target_arch = "x86_64")]
            if let Some(p) = p {
                rs.planes.extend((0..m).map(|i| p.row(i)));
            }
            let _ = p;
        }
        None => {}
    }
    // weight rows four a pass (`vnni4`) where x has VNNI planes
    #[cfg(target_arch = "x86_64")]
    let four = F && !rs.planes.is_empty();
    for (first, t, bytes, data) in ctx.w.runs_in(rows) {
        let count = data.len() / bytes;
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if four {
            // SAFETY: `four` only inside `decode_rows_avx2` (avx2, fma and f16c checked)
            done = unsafe { four_rows(ctx, &rs, t, bytes, data, first) };
        }
        for i in done..count {
            decode_row::<F>(
                ctx,
                &mut rs,
                t,
                &data[i * bytes..(i + 1) * bytes],
                first + i,
            );
        }
    }
}

/// A run's buffers and x's quantized rows (`ctx.xq`'s, with their VNNI planes where it has
/// them), for `decode_row`.
struct RowScratch<'x> {
    buf: [f32; CHUNK],
    sums: [f32; DECODE_MAX_ROWS],
    x8: Vec<int8::Row<'x>>,
    x16: Vec<int16::Row<'x>>,
    #[cfg(target_arch = "x86_64")]
    planes: Vec<super::vnni::PlaneRow<'x>>,
    /// A repacked row read back as its plain type (`repack::standard_row`).
    plain: Vec<u8>,
}

/// Row `r` (type `t`, bytes `row`) times every row of x.
#[inline(always)]
fn decode_row<const F: bool>(
    ctx: &Ctx<'_, '_>,
    rs: &mut RowScratch<'_>,
    t: super::QType,
    row: &[u8],
    r: usize,
) {
    let (m, k) = (ctx.m, ctx.k);
    #[cfg(target_arch = "x86_64")]
    let vnni = matches!(ctx.xq, Some(QuantizedX::Int16(..)))
        && rs.planes.first().is_some_and(|p| super::vnni::reads(p, t));
    #[cfg(not(target_arch = "x86_64"))]
    let vnni = false;
    if super::repack::repacked(t) && !vnni {
        // only the VNNI products read repacked rows: every other path takes them as their plain type
        let mut buf = std::mem::take(&mut rs.plain);
        let (t, row) = super::repack::standard_row(t, row, &mut buf);
        decode_row::<F>(ctx, rs, t, row, r);
        rs.plain = buf;
        return;
    }
    match ctx.xq.filter(|xq| xq.takes(t)) {
        Some(QuantizedX::Int8(_)) => {
            int8_row::<F>(ctx, &rs.x8, t, row, r);
            return;
        }
        Some(QuantizedX::Int16(..)) => {
            #[cfg(target_arch = "x86_64")]
            if vnni {
                int16_row_vnni(ctx, &rs.x16, &rs.planes, t, row, r);
                return;
            }
            int16_row::<F>(ctx, &rs.x16, t, row, r);
            return;
        }
        None => {}
    }
    #[cfg(target_arch = "x86_64")]
    if F && !ctx.xsum.is_empty() && super::dot_avx2::fused(t) {
        // SAFETY: F is true only inside `decode_rows_avx2` (avx2, fma and f16c checked);
        // the row holds k elements of t; x rows of k floats, xsum rows of k / 32.
        unsafe { fused_row(ctx, t, row, r) };
        return;
    }
    let sums = &mut rs.sums;
    sums.fill(0.0);
    let mut start = 0;
    while start < k {
        let len = (k - start).min(CHUNK);
        let w = &mut rs.buf[..len];
        dequantize_range(t, row, start, w, F);
        for (i, s) in sums[..m].iter_mut().enumerate() {
            *s += simd::dot::<F, f32>(&ctx.x[i * k + start..i * k + start + len], w);
        }
        start += len;
    }
    for (i, s) in sums[..m].iter().enumerate() {
        ctx.put(i, r, *s);
    }
}

/// The rows of a segment's run (`data`: rows of `bytes` bytes of type `t`, the first output
/// row `first`) four at a time where x has planes: with one row of x by `vnni4` where it takes
/// `t`, with more the repacked types and Q4_K / Q6_K (`repacked_passes`). Returns the rows done
/// (a multiple of 4; the rest go one at a time, the same bits).
///
/// # Safety
/// The CPU supports avx2, fma and f16c; 16-bit codes of x (`rs.x16`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn four_rows(
    ctx: &Ctx<'_, '_>,
    rs: &RowScratch<'_>,
    t: super::QType,
    bytes: usize,
    data: &[u8],
    first: usize,
) -> usize {
    use super::vnni4;
    if rs.planes.is_empty() {
        return 0;
    }
    if ctx.m > 1 {
        // planes are made only where `vnni()` (AVX-512 with VNNI granted), permuted where a
        // segment is repacked
        return if repacked_four(t) {
            repacked_passes(ctx, rs, t, bytes, data, first)
        } else {
            0
        };
    }
    // the VNNI units only: Q8_0's rows (AVX2 units) ran slower four a pass (SmolLM2's Q8_0
    // output matrix 1.25 -> 1.6 ms), and at the AVX2 level four rows' sums spill
    if !vnni4::takes(t) {
        return 0;
    }
    let (k, x) = (ctx.k, &rs.x16[0]);
    let passes = data.len() / bytes / vnni4::ROWS;
    for (i, four) in data.chunks_exact(vnni4::ROWS * bytes).enumerate() {
        // written out: `array::from_fn` here stayed a call per pass (7 % of a Q4_0 decode step)
        let (ab, cd) = four.split_at(2 * bytes);
        let rows: [&[u8]; vnni4::ROWS] = [&ab[..bytes], &ab[bytes..], &cd[..bytes], &cd[bytes..]];
        // planes are made only where `vnni()` (AVX-512 with VNNI granted); `takes(t)`; the
        // rows and x's row hold k elements
        let dots = vnni4::rows_dots_vnni(t, rows, k, x, &rs.planes[0]);
        for (j, v) in dots.into_iter().enumerate() {
            ctx.put(0, first + vnni4::ROWS * i + j, v);
        }
    }
    passes * vnni4::ROWS
}

/// Rows of x a pass of `repacked_passes` over four weight rows: each row of x keeps two
/// 512-bit sums a weight row and four plane registers, so four weight rows by two rows of x
/// fill the 32 registers (`vnni4::q4_0r_rows`).
#[cfg(target_arch = "x86_64")]
const X_ROWS: usize = 2;

/// Whether `repacked_passes` takes rows of `t` (at 2-8 rows of x): the repacked layouts and the
/// stored Q4_K / Q6_K rows (`kquant4`, natural planes), read four weight rows a pass as at one
/// row of x.
#[cfg(target_arch = "x86_64")]
fn repacked_four(t: super::QType) -> bool {
    use super::QType::{Q4_0R, Q4_1R, Q4_K, Q5_0R, Q6_K, Q8_0R};
    matches!(t, Q4_0R | Q5_0R | Q8_0R | Q4_1R | Q4_K | Q6_K)
}

/// `four_rows` at 2-8 rows of x for the repacked types and Q4_K / Q6_K (`repacked_four`): four
/// weight rows a pass, each group of them loaded once for `X_ROWS` rows of x and x's planes once
/// for the four (`vnni4::q4_0r_rows`, `q5_0r_rows`, `kquant4`); the same bits as
/// `int16_row_vnni`, which takes them one weight row at a time. Returns the rows done (whole
/// passes).
///
/// # Safety
/// As `four_rows`; `rs.planes` made (AVX-512 with VNNI granted) and permuted where a segment is
/// repacked (Q4_K / Q6_K read the natural planes, always made); `repacked_four(t)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn repacked_passes(
    ctx: &Ctx<'_, '_>,
    rs: &RowScratch<'_>,
    t: super::QType,
    bytes: usize,
    data: &[u8],
    first: usize,
) -> usize {
    use super::vnni4::ROWS;
    let (k, m) = (ctx.k, ctx.m);
    let passes = data.len() / bytes / ROWS;
    for (pass, four) in data.chunks_exact(ROWS * bytes).enumerate() {
        let at = four.as_ptr();
        let w = [at, at.add(bytes), at.add(2 * bytes), at.add(3 * bytes)];
        let mut i = 0;
        while i < m {
            let (x, p) = (&rs.x16[i..], &rs.planes[i..]);
            let col = first + ROWS * pass;
            let r = if m - i == 1 {
                put_dots(ctx, i, col, repacked_dots::<1>(t, w, k, &[x[0]], &[p[0]]));
                1
            } else {
                let dots = repacked_dots::<X_ROWS>(t, w, k, &[x[0], x[1]], &[p[0], p[1]]);
                put_dots(ctx, i, col, dots);
                X_ROWS
            };
            i += r;
        }
    }
    passes * ROWS
}

/// Writes `dots[j][r]` (weight row `col + j`, row `i + r` of x) to out.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn put_dots<const R: usize>(ctx: &Ctx<'_, '_>, i: usize, col: usize, dots: [[f32; R]; 4]) {
    for (j, d) in dots.iter().enumerate() {
        for (r, v) in d.iter().enumerate() {
            ctx.put(i + r, col + j, *v);
        }
    }
}

/// `vnni::row_dots_vnni::<R>` of each of the four repacked weight rows `w` (type `t`,
/// `repacked_four(t)`) with the rows of x `x` / `p`: the same integer sums and f32 steps per
/// pair (`Lanes::totals`), the same bits.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn repacked_dots<const R: usize>(
    t: super::QType,
    w: [*const u8; 4],
    k: usize,
    x: &[int16::Row<'_>; R],
    p: &[super::vnni::PlaneRow<'_>; R],
) -> [[f32; R]; 4] {
    use std::arch::x86_64::_mm256_setzero_ps;
    let mut acc = [[_mm256_setzero_ps(); R]; 4];
    let mut mins = [[_mm256_setzero_ps(); R]; 4];
    match t {
        super::QType::Q4_0R => super::vnni4::q4_0r_rows::<4, R>(w, k, x, p, &mut acc),
        super::QType::Q5_0R => super::vnni4::q5_0r_rows::<4, R>(w, k, x, p, &mut acc),
        super::QType::Q4_1R => super::q4_1r::rows::<4, R>(w, k, x, p, &mut acc, &mut mins),
        super::QType::Q4_K => {
            // two weight rows a call: four by two rows of x spill (`kquant4::q4_k_rows`)
            for h in 0..2 {
                let (w, mut a, mut m) = (
                    [w[2 * h], w[2 * h + 1]],
                    [acc[2 * h], acc[2 * h + 1]],
                    [mins[2 * h], mins[2 * h + 1]],
                );
                super::kquant4::q4_k_rows::<2, R>(w, k, x, p, &mut a, &mut m);
                (acc[2 * h], acc[2 * h + 1], mins[2 * h], mins[2 * h + 1]) =
                    (a[0], a[1], m[0], m[1]);
            }
        }
        super::QType::Q6_K => super::kquant4::q6_k_rows::<4, R>(w, k, x, p, &mut acc),
        _ => super::q8_0r::rows::<4, R>(w, k, x, p, &mut acc),
    }
    // no closure: it would not take this function's target features
    let mut out = [[0.0; R]; 4];
    for ((o, acc), mins) in out.iter_mut().zip(acc).zip(mins) {
        *o = int16::avx2::Lanes { acc, mins }.totals();
    }
    out
}

/// `$name`: row `r` (type `t`, `$m::takes(t)`, bytes `row`) dotted with every row of x
/// quantized by `$m` (`x`, its rows): on the AVX2 path (when `F`) up to 4 rows of x per pass
/// over it. One body for the 8- and 16-bit activations, whose modules offer the same `Row` /
/// `row_dot` / `row_dots_avx2`.
macro_rules! integer_row {
    ($name:ident, $m:ident) => {
        #[inline(always)]
        fn $name<const F: bool>(
            ctx: &Ctx<'_, '_>,
            x: &[$m::Row<'_>],
            t: super::QType,
            row: &[u8],
            r: usize,
        ) {
            let mut i = 0;
            #[cfg(target_arch = "x86_64")]
            while F && i < x.len() {
                use $m::row_dots_avx2;
                let k = ctx.k;
                let x = &x[i..];
                // SAFETY: F is true only inside `decode_rows_avx2` (avx2, fma and f16c
                // checked); `takes(t)`, the row and the rows of x hold k elements.
                let dots: &[f32] = unsafe {
                    match x.len() {
                        1 => &row_dots_avx2::<1>(t, row, k, &[x[0]]),
                        2 => &row_dots_avx2::<2>(t, row, k, &[x[0], x[1]]),
                        3 => &row_dots_avx2::<3>(t, row, k, &[x[0], x[1], x[2]]),
                        _ => &row_dots_avx2::<4>(t, row, k, &[x[0], x[1], x[2], x[3]]),
                    }
                };
                for (j, v) in dots.iter().enumerate() {
                    ctx.put(i + j, r, *v);
                }
                i += dots.len();
            }
            for (i, x) in x.iter().enumerate().skip(i) {
                ctx.put(i, r, $m::row_dot(t, row, *x));
            }
        }
    };
}
integer_row!(int8_row, int8);
integer_row!(int16_row, int16);

/// `int16_row` at AVX-512 with VNNI (`vnni::row_dots_vnni`): `x` the rows' codes, `p` their
/// planes; up to 4 rows of x per pass over the weight row.
#[cfg(target_arch = "x86_64")]
fn int16_row_vnni(
    ctx: &Ctx<'_, '_>,
    x: &[int16::Row<'_>],
    p: &[super::vnni::PlaneRow<'_>],
    t: super::QType,
    row: &[u8],
    r: usize,
) {
    use super::vnni::row_dots_vnni;
    let k = ctx.k;
    let mut i = 0;
    while i < x.len() {
        let (x, p) = (&x[i..], &p[i..]);
        // SAFETY: planes are made only where `vnni()` (AVX-512 with VNNI granted); `takes(t)`,
        // the row and the rows of x hold k elements.
        let dots: &[f32] = unsafe {
            match x.len() {
                1 => &row_dots_vnni::<1>(t, row, k, &[x[0]], &[p[0]]),
                2 => &row_dots_vnni::<2>(t, row, k, &[x[0], x[1]], &[p[0], p[1]]),
                3 => &row_dots_vnni::<3>(t, row, k, &[x[0], x[1], x[2]], &[p[0], p[1], p[2]]),
                _ => &row_dots_vnni::<4>(
                    t,
                    row,
                    k,
                    &[x[0], x[1], x[2], x[3]],
                    &[p[0], p[1], p[2], p[3]],
                ),
            }
        };
        for (j, v) in dots.iter().enumerate() {
            ctx.put(i + j, r, *v);
        }
        i += dots.len();
    }
}

/// Row `r` (type `t`, bytes `row`) dotted with every row of x in registers
/// (`dot_avx2::row_dots`), up to 4 rows of x per pass over it.
///
/// # Safety
/// As `dot_avx2::row_dots`, for every row of x.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused_row(ctx: &Ctx<'_, '_>, t: super::QType, row: &[u8], r: usize) {
    use super::dot_avx2::row_dots;
    let (k, kb) = (ctx.k, ctx.k / 32);
    let x = |i: usize| ctx.x.as_ptr().add(i * k);
    let s = |i: usize| ctx.xsum.as_ptr().add(i * kb);
    let mut i = 0;
    while i < ctx.m {
        let dots: &[f32] = match ctx.m - i {
            1 => &row_dots::<1>(t, row, k, &[x(i)], &[s(i)]),
            2 => &row_dots::<2>(t, row, k, &[x(i), x(i + 1)], &[s(i), s(i + 1)]),
            3 => &row_dots::<3>(
                t,
                row,
                k,
                &[x(i), x(i + 1), x(i + 2)],
                &[s(i), s(i + 1), s(i + 2)],
            ),
            _ => &row_dots::<4>(
                t,
                row,
                k,
                &[x(i), x(i + 1), x(i + 2), x(i + 3)],
                &[s(i), s(i + 1), s(i + 2), s(i + 3)],
            ),
        };
        for (j, v) in dots.iter().enumerate() {
            ctx.put(i + j, r, *v);
        }
        i += dots.len();
    }
}

/// One thread's buffers for `prefill_rows`, kept between calls.
#[derive(Default)]
struct Scratch {
    /// Output rows dequantized as `linear`'s panels `[ceil(rows / PANEL), k, PANEL]`.
    panels: Vec<f32>,
    /// A panel's weight rows dequantized, row-major `[PANEL, k + 16]`.
    rows: Vec<f32>,
    /// `linear`'s result for a block of x's rows `[rows, run]`.
    out: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The weight rows `rows` dequantized once into panels (`PANEL_SCRATCH_BYTES`) and multiplied
/// with every row of x by `linear` (its blocked path: x packed, K sliced).
fn prefill_rows(ctx: &Ctx<'_, '_>, rows: Range<usize>) {
    if let Some(QuantizedX::Int16(xq, _)) = ctx.xq {
        prefill_rows16(ctx, xq, rows);
        return;
    }
    let (m, k) = (ctx.m, ctx.k);
    let cols = rows.len();
    let panels = cols.div_ceil(PANEL);
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let Scratch {
            panels: packed,
            rows: dequantized,
            out,
        } = &mut *scratch;
        packed.resize(panels * k * PANEL, 0.0);
        // rows a cache line apart beyond k: at k a multiple of 1024 the 16 rows read side by
        // side would otherwise share an L1 set and evict each other on every read
        let stride = k + 16;
        dequantized.resize(PANEL * stride, 0.0);
        for p in 0..panels {
            // the panel's rows dequantized row-major (contiguous writes, 16 rows in L2), then
            // written out step-major: a scatter straight into the panel would touch a cache
            // line a weight
            let first = rows.start + p * PANEL;
            let count = (rows.end - first).min(PANEL);
            for j in 0..count {
                let (t, row) = ctx.w.row(first + j);
                let dst = &mut dequantized[j * stride..j * stride + k];
                dequantize_range(t, row, 0, dst, ctx.fast);
            }
            dequantized[count * stride..].fill(0.0);
            let panel = &mut packed[p * k * PANEL..(p + 1) * k * PANEL];
            transpose_into_panel(dequantized, stride, k, panel, ctx.fast);
        }
        let weight = ArrayView3::from_shape((panels, k, PANEL), &packed[..])
            .expect("panels of the run's rows");
        let bias = ctx.bias.map(|b| &b[rows.clone()]);
        let x = ArrayView2::from_shape((m, k), ctx.x).expect("x's rows");
        out.resize(m * cols, 0.0);
        let y = ArrayViewMut2::from_shape((m, cols), &mut out[..]).expect("the run's results");
        linear(x, weight, bias, y, 1).expect("shapes made to fit");
        for (i, sums) in out.chunks_exact(cols).enumerate() {
            // SAFETY: row i < m, columns rows.start..rows.end <= n: inside out `[m, n]`; no
            // other share writes these columns (OutPtr).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(ctx.out.0.add(i * ctx.n + rows.start), cols)
            };
            dst.copy_from_slice(sums);
        }
    });
}

thread_local! {
    static PANEL16: RefCell<(gemm16::Panel, Vec<[f32; PANEL]>)> = RefCell::default();
}

/// `prefill_rows` on the integer panels (`gemm16`): each panel of 16 weight rows widened once
/// to 16-bit codes and multiplied with every row of x's 16-bit codes `xq`.
fn prefill_rows16(ctx: &Ctx<'_, '_>, xq: &int16::QuantizedRows, rows: Range<usize>) {
    PANEL16.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let (panel, sums) = &mut *scratch;
        sums.resize(ctx.m, [0.0; PANEL]);
        let mut first = rows.start;
        while first < rows.end {
            let count = (rows.end - first).min(PANEL);
            // repacked rows as they are: the panel widens their groups in place
            let mut weights = [(super::QType::F32, &[][..]); PANEL];
            for (j, w) in weights[..count].iter_mut().enumerate() {
                *w = ctx.w.row(first + j);
            }
            panel.pack(&weights[..count], ctx.k, ctx.fast);
            // the next panel's bytes on their way from memory while this one's product runs:
            // packing read them cold (its widening showed as much as the product at 32 rows)
            let next = first + count;
            for r in next..(next + PANEL).min(rows.end) {
                prefetch_l2(ctx.w.row(r).1);
            }
            panel.product(xq, sums, ctx.fast);
            for (i, s) in sums.iter().enumerate() {
                for (j, v) in s[..count].iter().enumerate() {
                    ctx.put(i, first + j, *v);
                }
            }
            first += count;
        }
    });
}

/// The cache lines of `bytes` prefetched into L2 (a hint; nothing off x86-64).
#[inline(always)]
fn prefetch_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch reads nothing architecturally; the address is inside `bytes`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// `panel[i * PANEL + j] = rows[j * stride + i]` for the `PANEL` rows `j` and `i < k`: 8 x 8
/// blocks transposed in AVX registers when `fast`.
pub(super) fn transpose_into_panel(
    rows: &[f32],
    stride: usize,
    k: usize,
    panel: &mut [f32],
    fast: bool,
) {
    assert!(rows.len() >= (PANEL - 1) * stride + k && panel.len() == k * PANEL);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if fast {
        // SAFETY: `fast` is set only on a CPU with avx2, fma and f16c; the lengths are those
        // asserted above.
        done = unsafe { transpose_avx2(rows, stride, k, panel) };
    }
    let _ = fast;
    for i in done..k {
        for j in 0..PANEL {
            panel[i * PANEL + j] = rows[j * stride + i];
        }
    }
}

/// `transpose_into_panel` for the columns `0..k / 8 * 8` (returned).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_avx2(rows: &[f32], stride: usize, k: usize, panel: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let (src, dst) = (rows.as_ptr(), panel.as_mut_ptr());
    let whole = k / 8 * 8;
    for i in (0..whole).step_by(8) {
        for half in [0, 8] {
            // rows half..half + 8, columns i..i + 8: inside rows (i + 8 <= k) and the panel
            let r: [__m256; 8] =
                std::array::from_fn(|q| _mm256_loadu_ps(src.add((half + q) * stride + i)));
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let cols = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (c, v) in cols.iter().enumerate() {
                _mm256_storeu_ps(dst.add((i + c) * PANEL + half), *v);
            }
        }
    }
    whole
}
