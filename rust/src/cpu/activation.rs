//! SwiGLU's activation on the CPU: `out = silu(gate) * up` straight from the fused gate/up
//! projection's output `[T, 2I]` (gate columns, then up columns) into `out [T, I]`.
//!
//! torch spells it as `silu(gate)` (a new `[T, I]` buffer) then an in-place product: two passes
//! and two operator calls per layer. Here it is one pass and one call. silu is torch's formula,
//! `x / (1 + exp(-x))` in f32, with a vectorized `exp` within two ulp of the true value; in bf16
//! silu's result is rounded to bf16 before the product (what torch's bf16 `silu` then `mul`
//! keep), and the product rounded again.
use std::sync::Mutex;

use ndarray::{ArrayView2, ArrayViewMut2};

use super::elem::Elem;
use super::invalid;
#[cfg(target_arch = "x86_64")]
use super::isa::{self, IsaLevel};
use super::pool;
use crate::error::Result;

/// Elements of `out` below which a call runs on the calling thread alone (a decode step's
/// `[64, 1376]` is ~90 us of work: not worth waking a worker).
const MIN_PER_THREAD: usize = 1 << 17;

/// `out[t] = silu(gate_up[t, :I]) * gate_up[t, I:]` for every row; both contiguous. Large calls
/// are split by rows over `num_threads` threads at most.
pub fn silu_and_mul<T: Elem>(
    gate_up: ArrayView2<T>,
    mut out: ArrayViewMut2<T>,
    num_threads: usize,
) -> Result<()> {
    let (rows, width) = out.dim();
    if gate_up.dim() != (rows, 2 * width) {
        return Err(invalid(format!(
            "silu_and_mul: gate_up has shape {:?}, out {:?} (want [T, 2I], [T, I])",
            gate_up.shape(),
            out.shape()
        )));
    }
    let gate_up = gate_up
        .to_slice()
        .ok_or_else(|| invalid("gate_up must be contiguous"))?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let threads = num_threads.clamp(1, (rows * width / MIN_PER_THREAD).max(1));
    if threads == 1 {
        run(gate_up, out, width);
        return Ok(());
    }
    // a few chunks per thread, claimed in turn (a thread slowed by another process takes fewer)
    let chunk_rows = rows.div_ceil(threads * 4);
    let chunks: Vec<Mutex<&mut [T]>> = out.chunks_mut(chunk_rows * width).map(Mutex::new).collect();
    pool::WORKERS.run_claimed(threads, chunks.len(), |c| {
        let mut dst = chunks[c].lock().unwrap_or_else(|e| e.into_inner());
        let first = c * chunk_rows * 2 * width;
        let src = &gate_up[first..first + dst.len() * 2];
        run(src, &mut dst, width);
    });
    Ok(())
}

/// The rows of `gate_up` `[n, 2 * width]` into `out` `[n, width]`.
fn run<T: Elem>(gate_up: &[T], out: &mut [T], width: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa::level() >= IsaLevel::Avx512 {
        // SAFETY: the CPU supports the features the function is compiled for (checked above).
        unsafe { rows_avx512(gate_up, out, width) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for (checked above).
        unsafe { rows_avx2_fma(gate_up, out, width) };
        return;
    }
    rows_with::<PORTABLE, T>(gate_up, out, width);
}

/// The loops' levels (`rows_with`'s `L`).
const PORTABLE: u8 = 0;
const AVX2: u8 = 1;
const AVX512: u8 = 2;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2_fma<T: Elem>(gate_up: &[T], out: &mut [T], width: usize) {
    rows_with::<AVX2, T>(gate_up, out, width);
}

// the same loop, its widening and products on 16 lanes, silu on `simd_avx512::silu16`
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn rows_avx512<T: Elem>(gate_up: &[T], out: &mut [T], width: usize) {
    rows_with::<AVX512, T>(gate_up, out, width);
}

#[inline(always)]
fn rows_with<const L: u8, T: Elem>(gate_up: &[T], out: &mut [T], width: usize) {
    let mut act = vec![0.0f32; width];
    for (src, dst) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (gate, up) = src.split_at(width);
        for (a, g) in act.iter_mut().zip(gate) {
            *a = g.to_f32();
        }
        silu_in_place::<L>(&mut act);
        for ((d, a), u) in dst.iter_mut().zip(&act).zip(up) {
            *d = T::from_f32(T::round(*a) * u.to_f32());
        }
    }
}

/// `x / (1 + exp(-x))` for every element.
#[inline(always)]
fn silu_in_place<const L: u8>(xs: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if L == AVX512 {
        // SAFETY: `L` is AVX512 only inside `rows_avx512`, which runs only where the ISA level
        // is AVX-512 (`run`).
        done = unsafe { super::simd_avx512::silu16(xs) };
    } else if L == AVX2 {
        // SAFETY: `L` is AVX2 only inside functions compiled for avx2 + fma, which run only
        // after the CPU was checked for both (`run`).
        done = unsafe { silu_avx2_fma(xs) };
    }
    for x in &mut xs[done..] {
        *x /= 1.0 + (-*x).exp();
    }
}

/// silu over the whole 8-lane chunks of `xs`; returns how many elements it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn silu_avx2_fma(xs: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = xs.len() - xs.len() % 8;
    let one = _mm256_set1_ps(1.0);
    let sign = _mm256_set1_ps(-0.0);
    let p = xs.as_mut_ptr();
    let mut i = 0;
    while i < whole {
        let x = _mm256_loadu_ps(p.add(i));
        let e = super::simd::exp8(_mm256_xor_ps(x, sign));
        _mm256_storeu_ps(p.add(i), _mm256_div_ps(x, _mm256_add_ps(one, e)));
        i += 8;
    }
    whole
}

#[cfg(test)]
mod tests {
    use ndarray::Array2;

    use super::*;
    use crate::cpu::elem::Bf16;

    fn silu64(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    fn ulps(a: f32, b: f32) -> i64 {
        (a.to_bits() as i64 - b.to_bits() as i64).abs()
    }

    /// gate values spanning silu's range, up values around 1
    fn inputs(rows: usize, width: usize) -> Array2<f32> {
        Array2::from_shape_fn((rows, 2 * width), |(r, c)| {
            if c < width {
                ((r * width + c) as f32 * 0.731).sin() * 12.0
            } else {
                0.5 + ((r + c) as f32 * 0.17).cos()
            }
        })
    }

    #[test]
    fn f32_matches_silu_times_up_within_a_few_ulp() {
        let (rows, width) = (5, 37); // a tail after the 8-lane chunks
        let gate_up = inputs(rows, width);
        let mut out = Array2::zeros((rows, width));
        silu_and_mul(gate_up.view(), out.view_mut(), 1).unwrap();
        for r in 0..rows {
            for c in 0..width {
                let (g, u) = (gate_up[[r, c]], gate_up[[r, width + c]]);
                let want = (silu64(g as f64) as f32) * u;
                assert!(
                    ulps(out[[r, c]], want) <= 4,
                    "{r},{c}: {} vs {want}",
                    out[[r, c]]
                );
            }
        }
    }

    #[test]
    fn silu_at_the_ends_of_the_range() {
        let gate = [
            -200.0,
            -89.0,
            -88.5,
            -80.0,
            0.0,
            -0.0,
            80.0,
            100.0,
            f32::INFINITY,
        ];
        let width = gate.len() * 2; // two 8-lane chunks and a tail, each seeing the extremes
        let mut gate_up = Array2::from_elem((1, 2 * width), 1.0f32);
        for c in 0..width {
            gate_up[[0, c]] = gate[c % gate.len()];
        }
        let mut out = Array2::zeros((1, width));
        silu_and_mul(gate_up.view(), out.view_mut(), 1).unwrap();
        for c in 0..width {
            let (g, got) = (gate[c % gate.len()], out[[0, c]]);
            if g < -88.0 {
                assert!(got <= 0.0 && got > -1e-35, "silu({g}) = {got}");
            } else {
                assert!(ulps(got, silu64(g as f64) as f32) <= 2, "silu({g}) = {got}");
            }
        }
    }

    #[test]
    fn nan_stays_nan() {
        let mut gate_up = Array2::from_elem((1, 32), 1.0f32);
        gate_up[[0, 3]] = f32::NAN;
        gate_up[[0, 15]] = f32::NAN;
        let mut out = Array2::zeros((1, 16));
        silu_and_mul(gate_up.view(), out.view_mut(), 1).unwrap();
        assert!(out[[0, 3]].is_nan() && out[[0, 15]].is_nan());
        assert!(!out[[0, 4]].is_nan());
    }

    #[test]
    fn bf16_rounds_silu_then_the_product() {
        let (rows, width) = (3, 21);
        let wide = inputs(rows, width);
        let gate_up = wide.mapv(Bf16::from_f32);
        let mut out = Array2::from_elem((rows, width), Bf16(0));
        silu_and_mul(gate_up.view(), out.view_mut(), 1).unwrap();
        for r in 0..rows {
            for c in 0..width {
                let (g, u) = (gate_up[[r, c]].to_f32(), gate_up[[r, width + c]].to_f32());
                let act = Bf16::from_f32(silu64(g as f64) as f32).to_f32();
                let want = Bf16::from_f32(act * u);
                // silu's last f32 ulp may move its bf16 rounding by one step
                assert!((out[[r, c]].0 as i32 - want.0 as i32).abs() <= 1, "{r},{c}");
            }
        }
    }

    #[test]
    fn threads_split_rows_without_changing_the_result() {
        let (rows, width) = (257, 1100); // past MIN_PER_THREAD, rows not a multiple of chunks
        let gate_up = inputs(rows, width);
        let mut one = Array2::zeros((rows, width));
        let mut four = Array2::zeros((rows, width));
        silu_and_mul(gate_up.view(), one.view_mut(), 1).unwrap();
        silu_and_mul(gate_up.view(), four.view_mut(), 4).unwrap();
        assert_eq!(one, four);
    }

    #[test]
    fn an_out_of_the_wrong_width_is_rejected() {
        let gate_up = Array2::<f32>::zeros((2, 10));
        let mut out = Array2::<f32>::zeros((2, 4));
        let err = silu_and_mul(gate_up.view(), out.view_mut(), 1).unwrap_err();
        assert!(format!("{err}").contains("want [T, 2I], [T, I]"), "{err}");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_rows_give_the_avx2_rows_bits() {
        use crate::cpu::isa::{self, IsaLevel};
        if isa::level() < IsaLevel::Avx512 {
            return; // the AVX-512 loops run only at that level (CI tests each level it has)
        }
        // widths with no tail, an 8-lane chunk after the 16-lane ones, and a scalar tail
        for width in [16, 24, 37, 1376] {
            let gate_up = inputs(3, width);
            let gate_up = gate_up.as_slice().unwrap();
            let (mut wide, mut narrow) = (vec![0.0f32; 3 * width], vec![0.0f32; 3 * width]);
            // SAFETY: the level is AVX-512 (checked above), which includes AVX2 + FMA.
            unsafe {
                rows_avx512(gate_up, &mut wide, width);
                rows_avx2_fma(gate_up, &mut narrow, width);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&wide), bits(&narrow), "width {width}");
        }
    }
}
