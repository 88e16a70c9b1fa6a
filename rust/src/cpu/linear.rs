//! Linear layers on the CPU: `y = x W^T + b` over a weight packed once into column panels.
//!
//! At decode batch sizes (1-16 rows) the product is memory-bound: every weight is read once per
//! step and does a few multiply-adds. The layout makes that one sequential read: the `[N, K]`
//! weight is stored as `[ceil(N / PANEL), K, PANEL]` (panel `p` holds output columns
//! `p * PANEL..`, column-major within the panel, the last one zero-padded), so a register tile
//! of up to `TILE_ROWS` rows of x by `PANEL` columns walks its panel front to back with one
//! broadcast of x and two FMAs per weight vector. The same layout serves every row count (a
//! prefill chunk runs the same tiles over blocks of rows that stay in L2), so the engine holds
//! one copy of each weight.
//!
//! Each output element is one FMA chain over `k` in order, whatever the row count, tiling or
//! threads: a row's result does not depend on the batch it runs in. x, the panels, the bias and
//! y share one element type (`Elem`: f32 or bf16); sums are f32 and a bf16 y is rounded once.
use std::any::TypeId;
use std::ops::Range;

use ndarray::{ArrayView2, ArrayView3, ArrayViewMut2};

use super::elem::Elem;
use super::pool;
use crate::error::{Error, Result};

/// Output columns per panel: two AVX registers of f32.
pub const PANEL: usize = 16;
/// Rows of x per register tile: 2 accumulators a row, plus two weight registers and the
/// broadcast, within the 16 AVX registers.
const TILE_ROWS: usize = 6;
/// Bytes of x (as f32) per block of rows that every panel passes over while it stays in L2.
const X_BLOCK_BYTES: usize = 256 * 1024;
/// Below this many weight elements a share, a worker thread costs more than it saves.
const MIN_SHARE_ELEMS: usize = 1 << 16;
/// Runs of panels a call is cut into per thread, claimed by whichever thread is free.
const CHUNKS_PER_THREAD: usize = 4;

/// `out [M, N] = x [M, K] · W^T + bias` with W given as its panels `[ceil(N / PANEL), K,
/// PANEL]` (`pack_panels`). All contiguous. `num_threads` threads at most (the calling thread
/// and parked workers of the kernels' pool), each taking a run of panels.
pub fn linear<T: Elem>(
    x: ArrayView2<T>,
    panels: ArrayView3<T>,
    bias: Option<&[T]>,
    mut out: ArrayViewMut2<T>,
    num_threads: usize,
) -> Result<()> {
    let (m, k) = x.dim();
    let (num_panels, pk, width) = panels.dim();
    let (om, n) = out.dim();
    if width != PANEL || pk != k {
        return Err(invalid(format!(
            "weight panels have shape {:?}, expected [panels, {k}, {PANEL}] (x has {k} columns)",
            panels.shape()
        )));
    }
    if om != m || n.div_ceil(PANEL) != num_panels {
        return Err(invalid(format!(
            "out has shape {:?}, expected [{m}, N] with ceil(N / {PANEL}) = {num_panels} \
             (x's rows, the weight's panels)",
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
    let w = panels
        .to_slice()
        .ok_or_else(|| invalid("weight panels must be contiguous"))?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let widened;
    let x: &[f32] = if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (checked just above): the same elements, length and alignment.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) }
    } else {
        widened = x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        &widened
    };
    let ctx = Ctx {
        x,
        w,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        m,
        k,
        n,
    };
    let per_share = (MIN_SHARE_ELEMS / (k * PANEL)).max(1);
    let threads = num_threads.clamp(1, num_panels.div_ceil(per_share));
    if threads == 1 {
        run(&ctx, 0..num_panels);
        return Ok(());
    }
    // runs of panels claimed in turn, several per thread: on a busy machine a thread that
    // shares its core with another process does fewer of them
    let chunk = num_panels
        .div_ceil(threads * CHUNKS_PER_THREAD)
        .max(per_share);
    let chunks = num_panels.div_ceil(chunk);
    pool::WORKERS.run_claimed(threads, chunks, |c| {
        run(&ctx, c * chunk..((c + 1) * chunk).min(num_panels));
    });
    Ok(())
}

/// The panels `[ceil(N / PANEL), K, PANEL]` of a weight `[N, K]`, the last panel padded with
/// zeros (the layout `linear` reads; the Python side packs with torch the same way).
pub fn pack_panels<T: Elem>(w: ArrayView2<T>) -> Vec<T> {
    let (n, k) = w.dim();
    let mut panels = vec![T::ZERO; n.div_ceil(PANEL) * k * PANEL];
    for ((row, col), v) in w.indexed_iter() {
        panels[(row / PANEL) * k * PANEL + col * PANEL + row % PANEL] = *v;
    }
    panels
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// `out`'s first element; the shares write disjoint columns of it.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: each share writes only the columns of its own panels (`run`), and `linear` holds the
// exclusive borrow of `out` until every share has returned.
unsafe impl<T: Send> Send for OutPtr<T> {}
unsafe impl<T: Send> Sync for OutPtr<T> {}

struct Ctx<'a, T> {
    /// `[m, k]` as f32.
    x: &'a [f32],
    w: &'a [T],
    bias: Option<&'a [T]>,
    out: OutPtr<T>,
    m: usize,
    k: usize,
    n: usize,
}

fn run<T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features the function is compiled for (checked above).
        unsafe { run_avx2_fma(ctx, panels) };
        return;
    }
    run_with::<false, T>(ctx, panels);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2_fma<T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    run_with::<true, T>(ctx, panels);
}

#[inline(always)]
fn run_with<const F: bool, T: Elem>(ctx: &Ctx<'_, T>, panels: Range<usize>) {
    let k = ctx.k;
    let block = (X_BLOCK_BYTES / (4 * k) / TILE_ROWS * TILE_ROWS).max(TILE_ROWS);
    let mut first = 0;
    while first < ctx.m {
        let end = (first + block).min(ctx.m);
        for p in panels.clone() {
            let w = &ctx.w[p * k * PANEL..(p + 1) * k * PANEL];
            let mut row = first;
            while row < end {
                let rows = (end - row).min(TILE_ROWS);
                let x = &ctx.x[row * k..(row + rows) * k];
                let mut acc = [[0.0f32; PANEL]; TILE_ROWS];
                match rows {
                    1 => tile::<F, T, 1>(x, w, k, &mut acc),
                    2 => tile::<F, T, 2>(x, w, k, &mut acc),
                    3 => tile::<F, T, 3>(x, w, k, &mut acc),
                    4 => tile::<F, T, 4>(x, w, k, &mut acc),
                    5 => tile::<F, T, 5>(x, w, k, &mut acc),
                    _ => tile::<F, T, 6>(x, w, k, &mut acc),
                }
                store(ctx, &acc[..rows], row, p * PANEL);
                row += rows;
            }
        }
        first = end;
    }
}

/// Writes a tile's sums (plus the bias) to rows `row..` and columns `col..col + PANEL` of out,
/// those that exist (the last panel's padding columns are dropped).
#[inline(always)]
fn store<T: Elem>(ctx: &Ctx<'_, T>, acc: &[[f32; PANEL]], row: usize, col: usize) {
    let cols = (ctx.n - col).min(PANEL);
    for (r, sums) in acc.iter().enumerate() {
        // SAFETY: row + r < m and col + cols <= n: inside out `[m, n]`; no other share
        // writes these columns (OutPtr).
        let dst =
            unsafe { std::slice::from_raw_parts_mut(ctx.out.0.add((row + r) * ctx.n + col), cols) };
        match ctx.bias {
            Some(b) => {
                for ((d, s), b) in dst.iter_mut().zip(sums).zip(&b[col..col + cols]) {
                    *d = T::from_f32(s + b.to_f32());
                }
            }
            None => {
                for (d, s) in dst.iter_mut().zip(sums) {
                    *d = T::from_f32(*s);
                }
            }
        }
    }
}

/// `acc[r][j] = sum over i of x[r * k + i] * w[i * PANEL + j]` for the tile's `R` rows.
#[inline(always)]
fn tile<const F: bool, T: Elem, const R: usize>(
    x: &[f32],
    w: &[T],
    k: usize,
    acc: &mut [[f32; PANEL]; TILE_ROWS],
) {
    debug_assert!(x.len() == R * k && w.len() == k * PANEL);
    #[cfg(target_arch = "x86_64")]
    if F {
        // SAFETY: `F` is true only inside `run_avx2_fma`, which runs only on a CPU with avx2
        // and fma; the slices' lengths are those the loads read (asserted above).
        unsafe { tile_avx2_fma::<T, R>(x, w, k, acc) };
        return;
    }
    for i in 0..k {
        let wi = &w[i * PANEL..(i + 1) * PANEL];
        for r in 0..R {
            let a = x[r * k + i];
            for (s, wv) in acc[r].iter_mut().zip(wi) {
                *s += a * wv.to_f32();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile_avx2_fma<T: Elem, const R: usize>(
    x: &[f32],
    w: &[T],
    k: usize,
    acc: &mut [[f32; PANEL]; TILE_ROWS],
) {
    use std::arch::x86_64::*;

    use super::simd::load8;
    let (px, pw) = (x.as_ptr(), w.as_ptr());
    let mut sums = [[_mm256_setzero_ps(); 2]; R];
    // every load reads inside x[r * k + i] (r < R, i < k) and w[i * PANEL..(i + 1) * PANEL]
    for i in 0..k {
        let lo = load8(pw.add(i * PANEL));
        let hi = load8(pw.add(i * PANEL + 8));
        for (r, s) in sums.iter_mut().enumerate() {
            let a = _mm256_broadcast_ss(&*px.add(r * k + i));
            s[0] = _mm256_fmadd_ps(a, lo, s[0]);
            s[1] = _mm256_fmadd_ps(a, hi, s[1]);
        }
    }
    for (dst, s) in acc.iter_mut().zip(&sums) {
        _mm256_storeu_ps(dst.as_mut_ptr(), s[0]);
        _mm256_storeu_ps(dst.as_mut_ptr().add(8), s[1]);
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{Array2, Array3};

    use super::*;
    use crate::cpu::elem::Bf16;

    fn values(len: usize, seed: f32) -> Vec<f32> {
        (0..len).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
    }

    /// `x W^T + b` in f64 over the given f32 values.
    fn reference(x: &Array2<f32>, w: &Array2<f32>, b: Option<&[f32]>) -> Array2<f64> {
        let (m, k) = x.dim();
        let n = w.dim().0;
        Array2::from_shape_fn((m, n), |(r, c)| {
            let dot: f64 = (0..k).map(|i| x[[r, i]] as f64 * w[[c, i]] as f64).sum();
            dot + b.map_or(0.0, |b| b[c] as f64)
        })
    }

    fn run_f32(x: &Array2<f32>, w: &Array2<f32>, b: Option<&[f32]>, threads: usize) -> Array2<f32> {
        let (n, k) = w.dim();
        let panels =
            Array3::from_shape_vec((n.div_ceil(PANEL), k, PANEL), pack_panels(w.view())).unwrap();
        let mut out = Array2::from_elem((x.dim().0, n), f32::NAN);
        linear(x.view(), panels.view(), b, out.view_mut(), threads).unwrap();
        out
    }

    #[test]
    fn f32_matches_a_float64_reference_for_every_tile_height_and_ragged_panels() {
        for (m, k, n) in [
            (1, 7, 5),
            (3, 40, 33),
            (6, 64, 16),
            (7, 33, 47),
            (13, 100, 17),
        ] {
            let x = Array2::from_shape_vec((m, k), values(m * k, 1.0)).unwrap();
            let w = Array2::from_shape_vec((n, k), values(n * k, 2.0)).unwrap();
            let b = values(n, 3.0);
            for bias in [None, Some(&b[..])] {
                let got = run_f32(&x, &w, bias, 1);
                let want = reference(&x, &w, bias);
                for (g, w) in got.iter().zip(&want) {
                    assert!((*g as f64 - w).abs() < 1e-4, "{m}x{k}x{n}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_batch_or_threads() {
        let (k, n) = (300, 16 * 70 + 3);
        let x = Array2::from_shape_vec((20, k), values(20 * k, 4.0)).unwrap();
        let w = Array2::from_shape_vec((n, k), values(n * k, 5.0)).unwrap();
        let all = run_f32(&x, &w, None, 1);
        let threaded = run_f32(&x, &w, None, 3);
        assert_eq!(all, threaded);
        for r in [0, 5, 6, 19] {
            let one = run_f32(&x.slice(ndarray::s![r..r + 1, ..]).to_owned(), &w, None, 1);
            assert_eq!(one.row(0), all.row(r), "row {r}");
        }
    }

    #[test]
    fn bf16_sums_the_widened_values_in_f32_and_rounds_once() {
        let (m, k, n) = (3, 45, 21);
        let xb: Vec<Bf16> = values(m * k, 6.0).into_iter().map(Bf16::from_f32).collect();
        let wb: Vec<Bf16> = values(n * k, 7.0).into_iter().map(Bf16::from_f32).collect();
        let bb: Vec<Bf16> = values(n, 8.0).into_iter().map(Bf16::from_f32).collect();
        let xw = Array2::from_shape_vec((m, k), xb.iter().map(|v| v.to_f32()).collect()).unwrap();
        let ww = Array2::from_shape_vec((n, k), wb.iter().map(|v| v.to_f32()).collect()).unwrap();
        let bw: Vec<f32> = bb.iter().map(|v| v.to_f32()).collect();
        let want = run_f32(&xw, &ww, Some(&bw), 1);

        let x = Array2::from_shape_vec((m, k), xb).unwrap();
        let w = Array2::from_shape_vec((n, k), wb).unwrap();
        let panels =
            Array3::from_shape_vec((n.div_ceil(PANEL), k, PANEL), pack_panels(w.view())).unwrap();
        let mut out = Array2::from_elem((m, n), Bf16(0));
        linear(x.view(), panels.view(), Some(&bb), out.view_mut(), 1).unwrap();
        for (g, w) in out.iter().zip(&want) {
            assert_eq!(*g, Bf16::from_f32(*w));
        }
    }

    #[test]
    fn portable_and_avx2_tiles_agree_within_rounding() {
        let (k, n) = (77, 16);
        let x = values(6 * k, 9.0);
        let w: Vec<f32> = pack_panels(
            Array2::from_shape_vec((n, k), values(n * k, 10.0))
                .unwrap()
                .view(),
        );
        let mut portable = [[0.0f32; PANEL]; TILE_ROWS];
        tile::<false, f32, 6>(&x, &w, k, &mut portable);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            let mut fast = [[0.0f32; PANEL]; TILE_ROWS];
            // SAFETY: the CPU has avx2 and fma (checked above)
            unsafe { tile_avx2_fma::<f32, 6>(&x, &w, k, &mut fast) };
            for (a, b) in portable.iter().flatten().zip(fast.iter().flatten()) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_rejected_with_the_reason() {
        let x = Array2::<f32>::zeros((2, 8));
        let panels = Array3::<f32>::zeros((2, 8, PANEL));
        let mut out = Array2::<f32>::zeros((2, 40));
        let err = linear(x.view(), panels.view(), None, out.view_mut(), 1).unwrap_err();
        assert!(format!("{err}").contains("out has shape"), "{err}");
        let mut out = Array2::<f32>::zeros((2, 20));
        let err = linear(x.view(), panels.view(), Some(&[0.0; 3]), out.view_mut(), 1).unwrap_err();
        assert!(format!("{err}").contains("bias has 3 elements"), "{err}");
        let wide = Array2::<f32>::zeros((2, 9));
        let err = linear(wide.view(), panels.view(), None, out.view_mut(), 1).unwrap_err();
        assert!(
            format!("{err}").contains("weight panels have shape"),
            "{err}"
        );
    }
}
