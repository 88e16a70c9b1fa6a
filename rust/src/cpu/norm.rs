//! RMS norm on the CPU: `out = weight * (x * rsqrt(mean(x^2) + eps))` over each row, in one
//! pass per row. torch's `rms_norm` runs as five or six separate operators (~35 us for one
//! 512-wide row on this machine, 17 calls a decode step of an 8-layer model); this is one call.
//!
//! Sums and the scale are f32; a bf16 row is widened, and rounded as the reference formula
//! rounds it (`weight * (x32 * r).to(bf16)`: the normalized value, then the product).
//!
//! `add_rms_norm` is the residual stream's step between two blocks (vLLM's `fused_add_rms_norm`):
//! the block's output is added into the residual and the sum normalized, in one pass, in place,
//! instead of a torch add, a new buffer and a norm call.
use ndarray::{ArrayView2, ArrayViewMut2};

use super::elem::Elem;
use super::invalid;
use super::simd;
use crate::error::Result;

/// Normalizes every row of `x [T, E]` into `out [T, E]` (both contiguous rows).
pub fn rms_norm<T: Elem>(
    x: ArrayView2<T>,
    weight: &[T],
    eps: f32,
    mut out: ArrayViewMut2<T>,
) -> Result<()> {
    let (rows, width) = x.dim();
    if weight.len() != width || out.dim() != (rows, width) {
        return Err(invalid(format!(
            "rms_norm: x has shape {:?}, weight {} elements, out shape {:?} (want [T, E], [E], \
             [T, E])",
            x.shape(),
            weight.len(),
            out.shape()
        )));
    }
    let x = x
        .to_slice()
        .ok_or_else(|| invalid("x must be contiguous"))?;
    let out = out
        .as_slice_mut()
        .ok_or_else(|| invalid("out must be contiguous"))?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for (checked above).
        unsafe { rows_avx2_fma(x, weight, eps, out, width) };
        return Ok(());
    }
    rows_with::<false, T>(x, weight, eps, out, width);
    Ok(())
}

/// The residual step between two blocks, in place: `residual += x` (rounded to `T`, as torch's
/// add rounds it), then `x = rms_norm(residual)` by `weight` (the same arithmetic as
/// `rms_norm`). Both `[T, E]`, contiguous, distinct buffers.
pub fn add_rms_norm<T: Elem>(
    mut x: ArrayViewMut2<T>,
    mut residual: ArrayViewMut2<T>,
    weight: &[T],
    eps: f32,
) -> Result<()> {
    let (rows, width) = x.dim();
    if weight.len() != width || residual.dim() != (rows, width) {
        return Err(invalid(format!(
            "add_rms_norm: x has shape {:?}, residual {:?}, weight {} elements (want [T, E], \
             [T, E], [E])",
            x.shape(),
            residual.shape(),
            weight.len()
        )));
    }
    let x = x
        .as_slice_mut()
        .ok_or_else(|| invalid("x must be contiguous"))?;
    let residual = residual
        .as_slice_mut()
        .ok_or_else(|| invalid("residual must be contiguous"))?;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU supports the features the function is compiled for (checked above).
        unsafe { add_rows_avx2_fma(x, residual, weight, eps, width) };
        return Ok(());
    }
    add_rows_with::<false, T>(x, residual, weight, eps, width);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2_fma<T: Elem>(x: &[T], weight: &[T], eps: f32, out: &mut [T], width: usize) {
    rows_with::<true, T>(x, weight, eps, out, width);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_rows_avx2_fma<T: Elem>(
    x: &mut [T],
    residual: &mut [T],
    weight: &[T],
    eps: f32,
    width: usize,
) {
    add_rows_with::<true, T>(x, residual, weight, eps, width);
}

#[inline(always)]
fn rows_with<const F: bool, T: Elem>(x: &[T], weight: &[T], eps: f32, out: &mut [T], width: usize) {
    let mut wide = vec![0.0f32; width];
    for (row, dst) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        for (w, v) in wide.iter_mut().zip(row) {
            *w = v.to_f32();
        }
        normalize_row::<F, T>(&wide, weight, eps, dst);
    }
}

#[inline(always)]
fn add_rows_with<const F: bool, T: Elem>(
    x: &mut [T],
    residual: &mut [T],
    weight: &[T],
    eps: f32,
    width: usize,
) {
    let mut wide = vec![0.0f32; width];
    for (row, res) in x
        .chunks_exact_mut(width)
        .zip(residual.chunks_exact_mut(width))
    {
        for ((w, v), r) in wide.iter_mut().zip(row.iter()).zip(res.iter_mut()) {
            // the sum as the residual keeps it (rounded to T), which is what gets normalized
            *r = T::from_f32(v.to_f32() + r.to_f32());
            *w = r.to_f32();
        }
        normalize_row::<F, T>(&wide, weight, eps, row);
    }
}

/// `dst = weight * round(wide * rsqrt(mean(wide^2) + eps))` for one row widened to f32.
#[inline(always)]
fn normalize_row<const F: bool, T: Elem>(wide: &[f32], weight: &[T], eps: f32, dst: &mut [T]) {
    let mean = simd::dot::<F, f32>(wide, wide) / wide.len() as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((d, v), g) in dst.iter_mut().zip(wide).zip(weight) {
        *d = T::from_f32(g.to_f32() * T::round(v * scale));
    }
}

#[cfg(test)]
mod tests {
    use ndarray::Array2;

    use super::*;
    use crate::cpu::elem::Bf16;

    #[test]
    fn f32_rows_match_the_formula_in_f64() {
        let (rows, width) = (3, 37);
        let x = Array2::from_shape_fn((rows, width), |(r, c)| ((r * 31 + c) as f32 * 0.3).sin());
        let weight: Vec<f32> = (0..width).map(|c| 0.5 + c as f32 * 0.01).collect();
        let mut out = Array2::zeros((rows, width));
        rms_norm(x.view(), &weight, 1e-6, out.view_mut()).unwrap();
        for r in 0..rows {
            let ms: f64 = x.row(r).iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / width as f64;
            for c in 0..width {
                let want = weight[c] as f64 * x[[r, c]] as f64 / (ms + 1e-6).sqrt();
                assert!((out[[r, c]] as f64 - want).abs() < 1e-5, "{r},{c}");
            }
        }
    }

    #[test]
    fn bf16_rounds_the_normalized_value_then_the_product() {
        let x = Array2::from_shape_fn((2, 20), |(r, c)| Bf16::from_f32((r + c) as f32 * 0.7 - 5.0));
        let weight: Vec<Bf16> = (0..20)
            .map(|c| Bf16::from_f32(1.0 + c as f32 / 8.0))
            .collect();
        let mut out = Array2::from_elem((2, 20), Bf16(0));
        rms_norm(x.view(), &weight, 1e-5, out.view_mut()).unwrap();
        for r in 0..2 {
            let row: Vec<f32> = x.row(r).iter().map(|v| v.to_f32()).collect();
            let ms = row.iter().map(|v| v * v).sum::<f32>() / 20.0;
            let scale = 1.0 / (ms + 1e-5).sqrt();
            for c in 0..20 {
                let normed = Bf16::from_f32(row[c] * scale).to_f32();
                let want = Bf16::from_f32(weight[c].to_f32() * normed);
                // the sum's order may move the scale by an ulp: at most one bf16 step apart
                assert!((out[[r, c]].0 as i32 - want.0 as i32).abs() <= 1, "{r},{c}");
            }
        }
    }

    #[test]
    fn add_rms_norm_keeps_the_sum_and_normalizes_it_as_rms_norm_does() {
        let (rows, width) = (3, 45);
        let x = Array2::from_shape_fn((rows, width), |(r, c)| ((r * 7 + c) as f32 * 0.21).cos());
        let res = Array2::from_shape_fn((rows, width), |(r, c)| ((r + 3 * c) as f32 * 0.13).sin());
        let weight: Vec<f32> = (0..width).map(|c| 0.75 + c as f32 * 0.02).collect();
        let sum = &x + &res;
        let mut want = Array2::zeros((rows, width));
        rms_norm(sum.view(), &weight, 1e-6, want.view_mut()).unwrap();
        let (mut got, mut residual) = (x.clone(), res.clone());
        add_rms_norm(got.view_mut(), residual.view_mut(), &weight, 1e-6).unwrap();
        assert_eq!(residual, sum);
        assert_eq!(got, want);
    }

    #[test]
    fn add_rms_norm_rounds_the_bf16_sum_before_normalizing_it() {
        let bf = |v: f32| Bf16::from_f32(v);
        let x = Array2::from_shape_fn((2, 24), |(r, c)| bf((r + c) as f32 * 0.37 - 4.0));
        let res = Array2::from_shape_fn((2, 24), |(r, c)| bf((2 * r + c) as f32 * 0.011 + 0.3));
        let weight: Vec<Bf16> = (0..24).map(|c| bf(1.0 + c as f32 / 16.0)).collect();
        let sum = Array2::from_shape_fn((2, 24), |i| bf(x[i].to_f32() + res[i].to_f32()));
        let mut want = Array2::from_elem((2, 24), Bf16(0));
        rms_norm(sum.view(), &weight, 1e-5, want.view_mut()).unwrap();
        let (mut got, mut residual) = (x.clone(), res.clone());
        add_rms_norm(got.view_mut(), residual.view_mut(), &weight, 1e-5).unwrap();
        assert_eq!(residual, sum);
        assert_eq!(got, want);
    }

    #[test]
    fn add_rms_norm_rejects_a_residual_of_another_shape() {
        let mut x = Array2::<f32>::zeros((2, 8));
        let mut res = Array2::<f32>::zeros((3, 8));
        let err = add_rms_norm(x.view_mut(), res.view_mut(), &[1.0; 8], 1e-6).unwrap_err();
        assert!(format!("{err}").contains("residual [3, 8]"), "{err}");
    }

    #[test]
    fn a_weight_of_the_wrong_size_is_rejected() {
        let x = Array2::<f32>::zeros((2, 8));
        let mut out = Array2::<f32>::zeros((2, 8));
        let err = rms_norm(x.view(), &[1.0; 7], 1e-6, out.view_mut()).unwrap_err();
        assert!(format!("{err}").contains("weight 7 elements"), "{err}");
    }
}
