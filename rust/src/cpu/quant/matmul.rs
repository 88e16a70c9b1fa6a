//! `quant_linear`: `y [M, N] = x [M, K] · W^T + b` over a weight in ggml block formats.
use std::cell::RefCell;
use std::ops::Range;

use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

use super::{dequantize_range, fast, QuantMatrix};
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

/// `out [M, N] = x [M, K] · W^T + bias` for the weight `w [N, K]`; x and out contiguous.
/// `num_threads` threads at most (the caller and parked workers of the kernels' pool), each
/// taking runs of output rows (columns of out).
pub fn quant_linear(
    x: ArrayView2<f32>,
    w: &QuantMatrix<'_>,
    bias: Option<&[f32]>,
    mut out: ArrayViewMut2<f32>,
    num_threads: usize,
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
    // the decode path's AVX2 row dots add each sub-block's min times these sums once
    let xsum: Vec<f32> = if fast && m <= DECODE_MAX_ROWS && k % 32 == 0 {
        x.chunks_exact(32).map(|c| c.iter().sum()).collect()
    } else {
        Vec::new()
    };
    let ctx = Ctx {
        x,
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
        let chunk = n.div_ceil(threads * CHUNKS_PER_THREAD).max(per_share);
        run_runs(threads, n, chunk, |rows| decode_rows(&ctx, rows));
    } else {
        let chunk = (PANEL_SCRATCH_BYTES / (4 * k) / PANEL).max(1) * PANEL;
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
    let (m, k) = (ctx.m, ctx.k);
    let mut buf = [0.0f32; CHUNK];
    let mut sums = [0.0f32; DECODE_MAX_ROWS];
    for r in rows {
        let (t, row) = ctx.w.row(r);
        #[cfg(target_arch = "x86_64")]
        if F && !ctx.xsum.is_empty() && super::dot_avx2::fused(t) {
            // SAFETY: F is true only inside `decode_rows_avx2` (avx2, fma and f16c checked);
            // the row holds k elements of t; x rows of k floats, xsum rows of k / 32.
            unsafe { fused_row(ctx, t, row, r) };
            continue;
        }
        sums.fill(0.0);
        let mut start = 0;
        while start < k {
            let len = (k - start).min(CHUNK);
            let w = &mut buf[..len];
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
    /// One weight row dequantized.
    row: Vec<f32>,
    /// `linear`'s result for a block of x's rows `[rows, run]`.
    out: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The weight rows `rows` dequantized once into panels (`PANEL_SCRATCH_BYTES`) and multiplied
/// with every row of x by `linear` (its blocked path: x packed, K sliced).
fn prefill_rows(ctx: &Ctx<'_, '_>, rows: Range<usize>) {
    let (m, k) = (ctx.m, ctx.k);
    let cols = rows.len();
    let panels = cols.div_ceil(PANEL);
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let Scratch {
            panels: packed,
            row: dequantized,
            out,
        } = &mut *scratch;
        packed.clear();
        packed.resize(panels * k * PANEL, 0.0);
        dequantized.resize(k, 0.0);
        for (c, r) in rows.clone().enumerate() {
            let (t, row) = ctx.w.row(r);
            dequantize_range(t, row, 0, dequantized, ctx.fast);
            let panel = &mut packed[(c / PANEL) * k * PANEL..(c / PANEL + 1) * k * PANEL];
            for (i, v) in dequantized.iter().enumerate() {
                panel[i * PANEL + c % PANEL] = *v;
            }
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
