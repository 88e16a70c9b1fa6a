//! The decode path's optional integer products for the 32-element block types (Q8_0, Q4_0,
//! Q4_1, Q5_0, Q5_1), as llama.cpp computes them: each row of x is quantized once per call to
//! 8-bit codes with an f32 scale per 32 elements (`QuantizedRows`), and each block's product
//! is a sum of integer products (exact) scaled once: `Σ_blocks d_w·d_x · Σ q_w·q_x` (plus
//! `m_w · d_x·Σ q_x` for the types with a min). A weight costs a byte multiply-add instead of
//! a widening, a convert and an f32 multiply-add; the price is x's rounding to 8 bits.
//!
//! The integer sums of each block are kept as 8 partial sums of 4 consecutive elements (the
//! lanes AVX2's `maddubs` + `madd` leave), each scaled and added to its own f32 lane with a
//! separate multiply and add (no fused multiply-add), even and odd blocks into two sets of
//! lanes (two independent add chains), and the lanes summed in one fixed order: the AVX2 rows
//! (`row_dots_avx2`) and the portable ones (`row_dot`) agree bit for bit.
use super::formats::{f16_to_f32, five_bits, QType};

/// Elements per block of x (and of every type taken here).
const QK: usize = 32;

/// Whether the integer path takes rows of this type (the others keep the f32 path).
pub fn takes(t: QType) -> bool {
    matches!(
        t,
        QType::Q8_0 | QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1
    )
}

/// Rows of x `[m, k]` as blocks of 32 codes `q` in -127..=127 with the scale `d` = max |x| /
/// 127 of the block (x ≈ d·q, rounded half away from zero), and `s` = d · Σ q (what the min
/// of a Q4_1 / Q5_1 block multiplies).
pub type QuantizedRows = super::quantize::QuantizedRows<i8>;

/// One row of `QuantizedRows`.
pub type Row<'a> = super::quantize::Row<'a, i8>;

/// Block `b` of type `t` as its 32 codes (element order), scale and min (0 for the types
/// without one): the weight is `d·q + m`.
fn codes(t: QType, b: &[u8]) -> ([i8; QK], f32, f32) {
    let half = |at: usize| f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]));
    let mut q = [0i8; QK];
    match t {
        QType::Q8_0 => {
            for (q, v) in q.iter_mut().zip(&b[2..34]) {
                *q = *v as i8;
            }
            (q, half(0), 0.0)
        }
        QType::Q4_0 | QType::Q4_1 => {
            let (qs, offset) = if t == QType::Q4_0 { (2, 8) } else { (4, 0) };
            for (j, v) in b[qs..qs + 16].iter().enumerate() {
                q[j] = (v & 0xF) as i8 - offset;
                q[j + 16] = (v >> 4) as i8 - offset;
            }
            let m = if t == QType::Q4_1 { half(2) } else { 0.0 };
            (q, half(0), m)
        }
        QType::Q5_0 | QType::Q5_1 => {
            let (h, offset) = if t == QType::Q5_0 { (2, 16) } else { (4, 0) };
            let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
            for (j, v) in q.iter_mut().enumerate() {
                *v = five_bits(&b[h + 4..h + 20], qh, j) as i8 - offset;
            }
            let m = if t == QType::Q5_1 { half(2) } else { 0.0 };
            (q, half(0), m)
        }
        _ => unreachable!("{} is not a 32-element block type", t.name()),
    }
}

/// The even and odd blocks' lanes and mins summed, in the order of `row_dots_avx2`.
#[inline(always)]
fn total(even: [f32; 8], odd: [f32; 8], mins: [f32; 2]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|j| even[j] + odd[j]);
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) + (mins[0] + mins[1])
}

/// Whether blocks of `t` have a min (`d·q + m`: codes in 0..=31, unsigned).
#[inline(always)]
fn has_min(t: QType) -> bool {
    matches!(t, QType::Q4_1 | QType::Q5_1)
}

/// `Σ_i w[i] · x[i]` of the weight row `row` (type `t`, `takes(t)`) and the quantized row `x`
/// of as many elements, portably.
pub fn row_dot(t: QType, row: &[u8], x: Row<'_>) -> f32 {
    let bytes = t.block().1;
    let mut acc = [[0.0f32; 8]; 2];
    let mut mins = [0.0f32; 2];
    for (blk, b) in row.chunks_exact(bytes).enumerate() {
        let (w, dw, mw) = codes(t, b);
        let xq = &x.q[blk * QK..(blk + 1) * QK];
        let d = dw * x.d[blk];
        for (lane, (w, xq)) in acc[blk % 2]
            .iter_mut()
            .zip(w.chunks_exact(4).zip(xq.chunks_exact(4)))
        {
            let sum: i32 = w
                .iter()
                .zip(xq)
                .map(|(a, b)| i32::from(*a) * i32::from(*b))
                .sum();
            *lane += d * sum as f32;
        }
        if has_min(t) {
            mins[blk % 2] += mw * x.s[blk];
        }
    }
    total(acc[0], acc[1], mins)
}

#[cfg(target_arch = "x86_64")]
pub use avx2::row_dots_avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::dot_avx2::{bit4_of_each, half, nibbles32};
    use super::{Row, QK};
    use crate::cpu::quant::QType;

    /// Per row of x: the 8 f32 lanes and the mins' sum, of the even or the odd blocks.
    struct Acc<const R: usize> {
        lanes: [__m256; R],
        mins: [f32; R],
    }

    impl<const R: usize> Acc<R> {
        #[inline(always)]
        unsafe fn zero() -> Self {
            Self {
                lanes: [_mm256_setzero_ps(); R],
                mins: [0.0; R],
            }
        }
    }

    /// Adds block `blk` (codes `w`, scale `dw`, min `mw`) times block `blk` of each row of x.
    /// `SIGNED`: `w` holds signed codes (multiplied as |w| · (x with w's sign), `maddubs`
    /// taking one unsigned operand); otherwise codes in 0..=31.
    #[inline(always)]
    unsafe fn block<const R: usize, const SIGNED: bool>(
        w: __m256i,
        dw: f32,
        mw: f32,
        blk: usize,
        x: &[Row<'_>; R],
        acc: &mut Acc<R>,
    ) {
        let ones = _mm256_set1_epi16(1);
        let aw = if SIGNED { _mm256_sign_epi8(w, w) } else { w };
        for (r, x) in x.iter().enumerate() {
            // block blk of row r: inside it (blk < k / 32)
            let xq = _mm256_loadu_si256(x.q.as_ptr().add(QK * blk).cast());
            let xq = if SIGNED { _mm256_sign_epi8(xq, w) } else { xq };
            // pairs of products: |w| <= 128, |x| <= 127, so no i16 saturates
            let lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xq), ones);
            let d = _mm256_set1_ps(dw * *x.d.get_unchecked(blk));
            let scaled = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes));
            acc.lanes[r] = _mm256_add_ps(acc.lanes[r], scaled);
            if !SIGNED {
                // the types with a min (`has_min`) are the unsigned ones
                acc.mins[r] += mw * *x.s.get_unchecked(blk);
            }
        }
    }

    /// Block `blk` of the weight row `row` (type `t`) decoded, times block `blk` of each row
    /// of x, added to `acc`.
    #[inline(always)]
    unsafe fn block_of<const R: usize>(
        t: QType,
        row: &[u8],
        blk: usize,
        x: &[Row<'_>; R],
        acc: &mut Acc<R>,
    ) {
        // block blk: row[blk * bytes..(blk + 1) * bytes], inside the row
        let b = row.as_ptr().add(blk * t.block().1);
        match t {
            QType::Q8_0 => {
                let w = _mm256_loadu_si256(b.add(2).cast());
                block::<R, true>(w, half(b), 0.0, blk, x, acc);
            }
            QType::Q4_0 => {
                let w = _mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8));
                block::<R, true>(w, half(b), 0.0, blk, x, acc);
            }
            QType::Q4_1 => {
                block::<R, false>(nibbles32(b.add(4)), half(b), half(b.add(2)), blk, x, acc);
            }
            QType::Q5_0 => {
                let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
                let w = _mm256_or_si256(nibbles32(b.add(6)), bit4_of_each(qh));
                let w = _mm256_sub_epi8(w, _mm256_set1_epi8(16));
                block::<R, true>(w, half(b), 0.0, blk, x, acc);
            }
            QType::Q5_1 => {
                let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
                let w = _mm256_or_si256(nibbles32(b.add(8)), bit4_of_each(qh));
                block::<R, false>(w, half(b), half(b.add(2)), blk, x, acc);
            }
            _ => unreachable!("{} is not a 32-element block type", t.name()),
        }
    }

    /// `row_dot` for each of the `R` rows of x, the weight row decoded once.
    ///
    /// # Safety
    /// The CPU supports avx2, fma and f16c; `takes(t)`; `row` holds `k` elements of `t` and
    /// each row of x `k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_dots_avx2<const R: usize>(
        t: QType,
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
    ) -> [f32; R] {
        let (mut even, mut odd) = (Acc::<R>::zero(), Acc::<R>::zero());
        let blocks = k / QK;
        let mut blk = 0;
        while blk + 1 < blocks {
            block_of(t, row, blk, x, &mut even);
            block_of(t, row, blk + 1, x, &mut odd);
            blk += 2;
        }
        if blk < blocks {
            block_of(t, row, blk, x, &mut even);
        }
        let mut out = [0.0; R];
        for (r, o) in out.iter_mut().enumerate() {
            let (mut e, mut d) = ([0.0f32; 8], [0.0f32; 8]);
            _mm256_storeu_ps(e.as_mut_ptr(), even.lanes[r]);
            _mm256_storeu_ps(d.as_mut_ptr(), odd.lanes[r]);
            *o = super::total(e, d, [even.mins[r], odd.mins[r]]);
        }
        out
    }
}
