//! The decode path's row dots in AVX2, for the block types: each 32-element sub-block is
//! decoded in registers to 32 signed 8-bit values `q` (every type's fit: Q8_0's bytes, Q4_0's
//! nibbles - 8, Q6_K's 6 bits - 32, ...) with a scale per 16 elements and a min, and summed as
//! `d · Σ q·x + min · Σ x` (the sums of x per sub-block computed once per call): the
//! dequantized weight `d·q + min` is never stored, and a weight costs a widening, a convert
//! and a fused multiply-add per row of x. The sums differ from the dequantized product's only
//! in rounding.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::formats::{k_scale_min, QType};

/// Whether `row_dots` takes rows of this type (the others go through a dequantized chunk).
pub fn fused(t: QType) -> bool {
    !matches!(t, QType::F32 | QType::F16 | QType::BF16)
}

/// The f16 at `b` as f32, by F16C (branch-free: a scale a block is on the hot path).
#[inline(always)]
pub(super) unsafe fn half(b: *const u8) -> f32 {
    let h = i32::from(u16::from_le_bytes([*b, *b.add(1)]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// Sums of `R` rows of x: per row two vector accumulators (scales of the low and high 16
/// elements of a sub-block: two independent FMA chains) and the mins' scalar sum.
struct Sums<const R: usize> {
    acc: [[__m256; 2]; R],
    mins: [f32; R],
}

/// Adds sub-block `s` (32 values `q`, scales `d_lo` for the first 16 and `d_hi` for the last
/// 16, min `min`) dotted with elements `32 s..32 s + 32` of each row `x[r]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sub_block<const R: usize>(
    q: __m256i,
    d_lo: f32,
    d_hi: f32,
    min: f32,
    s: usize,
    x: &[*const f32; R],
    xsum: &[*const f32; R],
    sums: &mut Sums<R>,
) {
    let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
    let v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    let v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo)));
    let v2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    let v3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi)));
    let (dl, dh) = (_mm256_set1_ps(d_lo), _mm256_set1_ps(d_hi));
    for r in 0..R {
        // x[r] + 32 s .. + 32 s + 32 is inside row r of x (s < k / 32)
        let p = x[r].add(32 * s);
        let t = _mm256_fmadd_ps(
            v1,
            _mm256_loadu_ps(p.add(8)),
            _mm256_mul_ps(v0, _mm256_loadu_ps(p)),
        );
        sums.acc[r][0] = _mm256_fmadd_ps(dl, t, sums.acc[r][0]);
        let t = _mm256_fmadd_ps(
            v3,
            _mm256_loadu_ps(p.add(24)),
            _mm256_mul_ps(v2, _mm256_loadu_ps(p.add(16))),
        );
        sums.acc[r][1] = _mm256_fmadd_ps(dh, t, sums.acc[r][1]);
        // no branch on min: a 0 adds nothing
        sums.mins[r] += min * *xsum[r].add(s);
    }
}

/// Bytes whose bit 4 is bit i of `qh` (byte i of 32).
#[inline(always)]
pub(super) unsafe fn bit4_of_each(qh: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    // byte i holds byte i / 8 of qh; all ones but bit i % 8 set, then all ones iff it was set
    let others = _mm256_set1_epi64x(0x7FBF_DFEF_F7FB_FDFEu64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The 32 nibbles of Q4_0 / Q4_1's 16 bytes: low nibbles first, then high.
#[inline(always)]
pub(super) unsafe fn nibbles32(qs: *const u8) -> __m256i {
    let v = _mm_loadu_si128(qs.cast());
    let mask = _mm_set1_epi8(0xF);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), mask);
    _mm256_set_m128i(hi, lo)
}

/// `Σ_i w[i] · x[r][i]` of the row `row` (type `t`, `k` elements) for each of the `R` rows of
/// x; `xsum[r]` holds row r's sums of 32 elements.
///
/// # Safety
/// The CPU supports avx2, fma and f16c; `fused(t)`; `row` holds `k` elements of `t`; each
/// `x[r]` points to `k` floats and each `xsum[r]` to `k / 32`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_dots<const R: usize>(
    t: QType,
    row: &[u8],
    k: usize,
    x: &[*const f32; R],
    xsum: &[*const f32; R],
) -> [f32; R] {
    let mut sums = Sums::<R> {
        acc: [[_mm256_setzero_ps(); 2]; R],
        mins: [0.0; R],
    };
    let (elems, bytes) = t.block();
    let b0 = row.as_ptr();
    // one loop per type (the type's decoding inlined into it); block blk reads
    // row[blk * bytes..(blk + 1) * bytes]
    let blocks = k / elems;
    match t {
        QType::Q8_0 => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                let d = half(b);
                let q = _mm256_loadu_si256(b.add(2).cast());
                sub_block(q, d, d, 0.0, blk, x, xsum, &mut sums);
            }
        }
        QType::Q4_0 => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                let d = half(b);
                let q = _mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8));
                sub_block(q, d, d, 0.0, blk, x, xsum, &mut sums);
            }
        }
        QType::Q4_1 => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                let (d, m) = (half(b), half(b.add(2)));
                sub_block(nibbles32(b.add(4)), d, d, m, blk, x, xsum, &mut sums);
            }
        }
        QType::Q5_0 => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                let d = half(b);
                let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
                let q = _mm256_or_si256(nibbles32(b.add(6)), bit4_of_each(qh));
                let q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
                sub_block(q, d, d, 0.0, blk, x, xsum, &mut sums);
            }
        }
        QType::Q5_1 => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                let (d, m) = (half(b), half(b.add(2)));
                let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
                let q = _mm256_or_si256(nibbles32(b.add(8)), bit4_of_each(qh));
                sub_block(q, d, d, m, blk, x, xsum, &mut sums);
            }
        }
        QType::Q4_K => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                k_super_block(false, b, blk, x, xsum, &mut sums);
            }
        }
        QType::Q5_K => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                k_super_block(true, b, blk, x, xsum, &mut sums);
            }
        }
        QType::Q6_K => {
            for blk in 0..blocks {
                let b = b0.add(blk * bytes);
                q6_k_super_block(b, blk, x, xsum, &mut sums);
            }
        }
        QType::F32
        | QType::F16
        | QType::BF16
        | QType::Q4_0R
        | QType::Q5_0R
        | QType::Q8_0R
        | QType::Q4_1R => {
            unreachable!("not fused")
        }
    }
    let mut out = [0.0; R];
    for (r, o) in out.iter_mut().enumerate() {
        *o = hsum(_mm256_add_ps(sums.acc[r][0], sums.acc[r][1])) + sums.mins[r];
    }
    out
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// A Q4_K or (`five_bits`) Q5_K super-block (number `blk`: sub-blocks 8 blk..8 blk + 8).
#[inline(always)]
unsafe fn k_super_block<const R: usize>(
    five_bits: bool,
    b: *const u8,
    blk: usize,
    x: &[*const f32; R],
    xsum: &[*const f32; R],
    sums: &mut Sums<R>,
) {
    let (d, dmin) = (half(b), half(b.add(2)));
    let scales = std::slice::from_raw_parts(b.add(4), 12);
    let (qh, qs) = if five_bits {
        (Some(_mm256_loadu_si256(b.add(16).cast())), b.add(48))
    } else {
        (None, b.add(16))
    };
    let mask = _mm256_set1_epi8(0xF);
    for j in 0..4 {
        let v = _mm256_loadu_si256(qs.add(32 * j).cast());
        let halves = [
            _mm256_and_si256(v, mask),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
        ];
        for (h, mut q) in halves.into_iter().enumerate() {
            let i = 2 * j + h;
            if let Some(qh) = qh {
                // bit i of each qh byte, as bit 4 (a 16-bit shift, then masked per byte)
                let bit = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(i as i32));
                let bit = _mm256_slli_epi16::<4>(_mm256_and_si256(bit, _mm256_set1_epi8(1)));
                q = _mm256_or_si256(q, bit);
            }
            let (sc, m) = k_scale_min(scales, i);
            let dl = d * sc as f32;
            sub_block(q, dl, dl, -(dmin * m as f32), 8 * blk + i, x, xsum, sums);
        }
    }
}

/// A Q6_K super-block (number `blk`): per half h and quarter k, 32 values with a scale per 16.
#[inline(always)]
unsafe fn q6_k_super_block<const R: usize>(
    b: *const u8,
    blk: usize,
    x: &[*const f32; R],
    xsum: &[*const f32; R],
    sums: &mut Sums<R>,
) {
    let (ql, qh, scales) = (b, b.add(128), b.add(192));
    let d = half(b.add(208));
    for h in 0..2 {
        let high_bits = _mm256_loadu_si256(qh.add(32 * h).cast());
        for k in 0..4 {
            let low = _mm256_loadu_si256(ql.add(64 * h + 32 * (k % 2)).cast());
            let low = _mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (k / 2) as i32));
            let low = _mm256_and_si256(low, _mm256_set1_epi8(0xF));
            let high = _mm256_srl_epi16(high_bits, _mm_cvtsi32_si128(2 * k as i32));
            let high = _mm256_slli_epi16::<4>(_mm256_and_si256(high, _mm256_set1_epi8(3)));
            let q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
            let s = 8 * h + 2 * k;
            let d_lo = d * (*scales.add(s) as i8) as f32;
            let d_hi = d * (*scales.add(s + 1) as i8) as f32;
            sub_block(q, d_lo, d_hi, 0.0, 8 * blk + 4 * h + k, x, xsum, sums);
        }
    }
}
