//! Float rows quantized to Q8_0 and Q4_0 (for checkpoints quantized at load), with the
//! rounding of ggml's reference quantizers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`)
//! as the `gguf` package reproduces them, byte for byte; and the decode path's activations
//! quantized to 8- or 16-bit codes per 32 elements (`QuantizedRows`, one quantizer over the
//! code width `Code`: `int8` and `int16` read it).

use super::formats::{f32_to_f16, QType};
use crate::cpu::invalid;
use crate::error::Result;

/// Quantizes `src` (whole blocks of 32 floats) into `dst` (their blocks' bytes) as `t`.
pub fn quantize_blocks(t: QType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let block: fn(&[f32], &mut [u8]) = match t {
        QType::Q8_0 => q8_0,
        QType::Q4_0 => q4_0,
        _ => {
            return Err(invalid(format!(
                "quantizing to {} is not supported (Q8_0 and Q4_0 are)",
                t.name()
            )))
        }
    };
    let (elems, bytes) = t.block();
    if !src.len().is_multiple_of(elems) || dst.len() != src.len() / elems * bytes {
        return Err(invalid(format!(
            "{} floats do not fill {} bytes of {} blocks",
            src.len(),
            dst.len(),
            t.name()
        )));
    }
    for (x, b) in src.chunks_exact(elems).zip(dst.chunks_exact_mut(bytes)) {
        block(x, b);
    }
    Ok(())
}

/// d = max |x| / 127, q = round(x / d) (half away from zero), d stored as f16.
fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (q, v) in b[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// d = (the value of largest magnitude, sign kept) / -8, q = trunc(x / d + 8.5) clamped to 15.
/// ggml computes `x * id + 8.5` with one rounding (a fused multiply-add); the product of two
/// f32 is exact in f64, so the sum rounded once in f64 and then to f32 is what `gguf` does.
fn q4_0(x: &[f32], b: &mut [u8]) {
    let mut max = 0.0f32;
    for v in x {
        if v.abs() > max.abs() {
            max = *v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    let q = |v: f32| {
        ((f64::from(v) * f64::from(id) + 8.5) as f32)
            .trunc()
            .clamp(0.0, 15.0) as u8
    };
    for j in 0..16 {
        b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// An integer code of the decode path's quantized activations (`int8`, `int16`): its largest
/// magnitude and its rounding.
pub trait Code: Copy + Default {
    /// The largest code: a block's scale is max |x| / `MAX`.
    const MAX: f32;
    /// The multiplier taking a block of scale `d` to its codes (0 where its codes are all 0).
    fn inverse(d: f32) -> f32;
    /// `v` (already times the inverse scale) rounded to a code; `as` saturates and takes NaN
    /// to 0.
    fn code(v: f32) -> Self;
    fn wide(self) -> i32;
    /// The 32 elements `c` times `id` as codes into `q`; returns their sum. `fast`: the CPU
    /// has avx2 (a type may take it; the codes are the same).
    #[inline(always)]
    fn codes(c: &[f32], id: f32, q: &mut [Self], fast: bool) -> i32 {
        let _ = fast;
        portable_codes(c, id, q)
    }
}

/// `Code::codes` one element at a time.
#[inline(always)]
fn portable_codes<C: Code>(c: &[f32], id: f32, q: &mut [C]) -> i32 {
    let mut sum = 0i32;
    for (v, q) in c.iter().zip(q.iter_mut()) {
        *q = C::code(v * id);
        sum += q.wide();
    }
    sum
}

/// 8-bit codes, llama.cpp's: rounded half away from zero; a zero scale codes to 0.
impl Code for i8 {
    const MAX: f32 = 127.0;
    #[inline(always)]
    fn inverse(d: f32) -> f32 {
        if d != 0.0 {
            1.0 / d
        } else {
            0.0
        }
    }
    #[inline(always)]
    fn code(v: f32) -> Self {
        v.round() as i8
    }
    #[inline(always)]
    fn wide(self) -> i32 {
        i32::from(self)
    }
}

/// 16-bit codes: rounded to nearest, ties to even (AVX2's default rounding); a scale that is
/// not normal (a block under ~4e-34, whose inverse may overflow, or not finite) codes to 0.
impl Code for i16 {
    const MAX: f32 = 32767.0;
    #[inline(always)]
    fn inverse(d: f32) -> f32 {
        if d.is_normal() {
            1.0 / d
        } else {
            0.0
        }
    }
    #[inline(always)]
    fn code(v: f32) -> Self {
        v.round_ties_even() as i16
    }
    #[inline(always)]
    fn wide(self) -> i32 {
        i32::from(self)
    }
    #[inline(always)]
    fn codes(c: &[f32], id: f32, q: &mut [Self], fast: bool) -> i32 {
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: `fast` is set only on a CPU with avx2 (`super::fast`); 32 of each.
            return unsafe { avx2::codes_i16(c, id, q) };
        }
        let _ = fast;
        portable_codes(c, id, q)
    }
}

/// Elements per block of quantized activations.
const QK: usize = 32;

/// Rows of x `[m, k]` as blocks of 32 codes `q` with the scale `d` = max |x| / `C::MAX` of
/// the block (x ≈ d·q, rounded as `C` rounds), and `s` = d · Σ q (what a weight's min
/// multiplies). A block holding a NaN or an infinity gets a NaN scale: its products are NaN,
/// as the f32 path's would be.
pub struct QuantizedRows<C> {
    /// `[m, k]`.
    q: Vec<C>,
    /// `[m, k / 32]`.
    d: Vec<f32>,
    /// `[m, k / 32]`.
    s: Vec<f32>,
    k: usize,
}

/// One row of `QuantizedRows`.
#[derive(Clone, Copy)]
pub struct Row<'a, C> {
    pub q: &'a [C],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl<C: Code> QuantizedRows<C> {
    /// `x [m, k]` quantized; `k` a multiple of 32; `fast`: the CPU has avx2.
    pub fn new(x: &[f32], k: usize, fast: bool) -> Self {
        assert!(k.is_multiple_of(QK) && x.len().is_multiple_of(k.max(1)));
        let blocks = x.len() / QK;
        let mut rows = Self {
            q: vec![C::default(); x.len()],
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
            k,
        };
        let parts = rows
            .q
            .chunks_exact_mut(QK)
            .zip(rows.d.iter_mut().zip(rows.s.iter_mut()));
        for (c, (q, (d, s))) in x.chunks_exact(QK).zip(parts) {
            let amax = c.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            *d = if c.iter().all(|v| v.is_finite()) {
                amax / C::MAX
            } else {
                f32::NAN
            };
            *s = *d * C::codes(c, C::inverse(*d), q, fast) as f32;
        }
        rows
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> Row<'_, C> {
        let kb = self.k / QK;
        Row {
            q: &self.q[i * self.k..(i + 1) * self.k],
            d: &self.d[i * kb..(i + 1) * kb],
            s: &self.s[i * kb..(i + 1) * kb],
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// 32 elements `c` times `id`, rounded to nearest (ties to even, the default rounding
    /// mode, as `round_ties_even`) and saturated to i16 into `q`; returns their sum.
    ///
    /// # Safety
    /// The CPU supports avx2; `c` and `q` hold 32 elements.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn codes_i16(c: &[f32], id: f32, q: &mut [i16]) -> i32 {
        debug_assert!(c.len() == super::QK && q.len() == super::QK);
        let (id, p) = (_mm256_set1_ps(id), c.as_ptr());
        let mut int = [_mm256_setzero_si256(); 4];
        for (i, v) in int.iter_mut().enumerate() {
            *v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8 * i)), id));
        }
        // packs interleaves the 128-bit halves (0-3 8-11 4-7 12-15): put back in order
        let lo = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(int[0], int[1]));
        let hi = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(int[2], int[3]));
        _mm256_storeu_si256(q.as_mut_ptr().cast(), lo);
        _mm256_storeu_si256(q.as_mut_ptr().add(16).cast(), hi);
        let ones = _mm256_set1_epi16(1);
        let sums = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(sums),
            _mm256_extracti128_si256::<1>(sums),
        );
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4E>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0xB1>(s));
        _mm_cvtsi128_si32(s)
    }
}
