//! The decode path's integer products with 16-bit activations, for every quantized type (Q8_0,
//! Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): each row of x is quantized once per call to
//! 16-bit codes with an f32 scale per 32 elements (`QuantizedRows`: x ≈ d·q, |q| <= 32767, an
//! error of at most d / 2 = max |x| / 65534 of the block, 258 times finer than 8-bit codes), the
//! weights are widened to 16-bit integers in registers and multiplied with `madd` (AVX2's
//! `vpmaddwd`: 16 products a multiply-add, summed in pairs to 32-bit lanes), and each
//! 32-element block's integer sums are scaled once: `Σ_blocks d_w·d_x · Σ q_w·q_x` (plus
//! `m_w · d_x·Σ q_x` for the types with a min: Q4_1, Q5_1 and the Q4_K / Q5_K sub-blocks).
//!
//! No integer sum overflows: a block's weight codes are at most 4096 in magnitude (Q8_0's
//! 128, the 4- and 5-bit codes' 31, Q6_K's codes (-32..=31) times its 8-bit sub-block scale
//! (-128..=127), folded into the code: 32 · 128), x's at most 32767, so a 32-bit lane, which
//! sums 4 products, holds at most 4 · 32767 · 4096 < 2^29 (`madd`'s one overflow, two products
//! of -32768 · -32768, cannot happen: x's codes stop at -32767).
//!
//! As in `int8`, each block's sums are kept as the 8 lanes AVX2 leaves (lane j: elements 2j,
//! 2j + 1, 16 + 2j and 17 + 2j), each converted, scaled and added to its own f32 lane with a
//! separate multiply and add, even and odd blocks into two sets of lanes (two add chains), and
//! the lanes summed in one fixed order: the AVX2 rows (`row_dots_avx2`) and the portable ones
//! (`row_dot`) agree bit for bit.
use super::formats::{f16_to_f32, five_bits, QType, QK_K};

/// Elements per block of x (and per block or sub-block of every type taken here).
const QK: usize = 32;
/// The largest code of x.
const MAX_CODE: f32 = 32767.0;

/// Whether the integer path takes rows of this type (F32 / F16 / BF16 keep the f32 path).
pub fn takes(t: QType) -> bool {
    !matches!(t, QType::F32 | QType::F16 | QType::BF16)
}

/// Rows of x `[m, k]` as blocks of 32 codes `q` in -32767..=32767 with the scale `d` = max |x|
/// / 32767 of the block (x ≈ d·q, rounded to nearest, ties to even), and `s` = d · Σ q (what a
/// min multiplies); a block under ~4e-34 in magnitude has codes of 0. A block holding a NaN or an infinity gets a NaN scale: its products are
/// NaN, as the f32 path's would be.
pub struct QuantizedRows {
    /// `[m, k]`.
    q: Vec<i16>,
    /// `[m, k / 32]`.
    d: Vec<f32>,
    /// `[m, k / 32]`.
    s: Vec<f32>,
    k: usize,
}

/// One row of `QuantizedRows`.
#[derive(Clone, Copy)]
pub struct Row<'a> {
    pub q: &'a [i16],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl QuantizedRows {
    /// `x [m, k]` quantized; `k` a multiple of 32; on the AVX2 path when `fast`.
    pub fn new(x: &[f32], k: usize, fast: bool) -> Self {
        assert!(k.is_multiple_of(QK) && x.len().is_multiple_of(k.max(1)));
        let blocks = x.len() / QK;
        let mut rows = Self {
            q: vec![0; x.len()],
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
                amax / MAX_CODE
            } else {
                f32::NAN
            };
            // a block under ~4e-34 (a subnormal scale, whose inverse may overflow) or not
            // finite gets codes of 0
            let id = if d.is_normal() { 1.0 / *d } else { 0.0 };
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: `fast` is set only on a CPU with avx2 (`super::fast`); 32 of each.
                *s = *d * unsafe { avx2::codes_of(c, id, q) } as f32;
                continue;
            }
            let _ = fast;
            let mut sum = 0i32;
            for (v, q) in c.iter().zip(q.iter_mut()) {
                // |v · id| <= 32767 up to rounding; `as` saturates (and takes NaN to 0)
                *q = (v * id).round_ties_even() as i16;
                sum += i32::from(*q);
            }
            *s = *d * sum as f32;
        }
        rows
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> Row<'_> {
        let kb = self.k / QK;
        Row {
            q: &self.q[i * self.k..(i + 1) * self.k],
            d: &self.d[i * kb..(i + 1) * kb],
            s: &self.s[i * kb..(i + 1) * kb],
        }
    }
}

/// A Q4_K / Q5_K super-block's 8 sub-block scales and 8 mins (6 bits each, 12 bytes), unpacked
/// as llama.cpp does (`formats::k_scale_min`, four at a time).
#[inline(always)]
pub fn k_scales(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a, b, c) = (word(0), word(1), word(2));
    let scales_hi = (c & LOW4) | (((a >> 6) & LOW2) << 4);
    let mins_hi = ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4);
    let join = |lo: u32, hi: u32| {
        let (lo, hi) = (lo.to_le_bytes(), hi.to_le_bytes());
        std::array::from_fn(|i| if i < 4 { lo[i] } else { hi[i - 4] })
    };
    (join(a & LOW6, scales_hi), join(b & LOW6, mins_hi))
}

/// Block `blk` (32 elements) of the row `row` of type `t` as its 32 integer weights `w`
/// (element order), scale and min: the weight is `d·w + m` (Q6_K's codes carry their sub-block
/// scale: `d` is the super-block's).
fn codes(t: QType, row: &[u8], blk: usize) -> ([i16; QK], f32, f32) {
    let half = |b: &[u8], at: usize| f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]));
    let mut q = [0i16; QK];
    let bytes = t.block().1;
    if t.block().0 == QK_K {
        let b = &row[blk / 8 * bytes..(blk / 8 + 1) * bytes];
        let i = blk % 8;
        if t == QType::Q6_K {
            let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
            let (h, k) = (i / 4, i % 4);
            for (l, v) in q.iter_mut().enumerate() {
                let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
                let high = (qh[32 * h + l] >> (2 * k)) & 3;
                let scale = i16::from(scales[2 * i + l / 16] as i8);
                *v = (i16::from(low | (high << 4)) - 32) * scale;
            }
            return (q, half(b, 208), 0.0);
        }
        let (scales, mins) = k_scales(&b[4..16]);
        let qs = if t == QType::Q5_K { 48 } else { 16 };
        let group = &b[qs + 32 * (i / 2)..qs + 32 * (i / 2) + 32];
        for (l, v) in q.iter_mut().enumerate() {
            let bit4 = if t == QType::Q5_K {
                ((b[16 + l] >> i) & 1) << 4
            } else {
                0
            };
            *v = i16::from(((group[l] >> (4 * (i % 2))) & 0xF) | bit4);
        }
        let dl = half(b, 0) * scales[i] as f32;
        return (q, dl, -(half(b, 2) * mins[i] as f32));
    }
    let b = &row[blk * bytes..(blk + 1) * bytes];
    match t {
        QType::Q8_0 => {
            for (q, v) in q.iter_mut().zip(&b[2..34]) {
                *q = i16::from(*v as i8);
            }
            (q, half(b, 0), 0.0)
        }
        QType::Q4_0 | QType::Q4_1 => {
            let (qs, offset) = if t == QType::Q4_0 { (2, 8) } else { (4, 0) };
            for (j, v) in b[qs..qs + 16].iter().enumerate() {
                q[j] = i16::from(v & 0xF) - offset;
                q[j + 16] = i16::from(v >> 4) - offset;
            }
            let m = if t == QType::Q4_1 { half(b, 2) } else { 0.0 };
            (q, half(b, 0), m)
        }
        QType::Q5_0 | QType::Q5_1 => {
            let (h, offset) = if t == QType::Q5_0 { (2, 16) } else { (4, 0) };
            let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
            for (j, v) in q.iter_mut().enumerate() {
                *v = i16::from(five_bits(&b[h + 4..h + 20], qh, j)) - offset;
            }
            let m = if t == QType::Q5_1 { half(b, 2) } else { 0.0 };
            (q, half(b, 0), m)
        }
        _ => unreachable!("{} is not a quantized type", t.name()),
    }
}

/// Whether the weights of type `t` are `d·w + m` (a min per block or sub-block). The others
/// skip the mins: a zero min would add only a zero (to lanes that start at +0 and so are never
/// -0: no sign changes) or a NaN of x (already in the lanes through the block's scale), so the
/// sums are bit for bit those with the zero mins added.
fn has_min(t: QType) -> bool {
    matches!(t, QType::Q4_1 | QType::Q5_1 | QType::Q4_K | QType::Q5_K)
}

/// The even and odd blocks' lanes and mins summed, in the order of `row_dots_avx2`.
#[inline(always)]
fn total(even: [f32; 8], odd: [f32; 8], mins: [f32; 2]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|j| even[j] + odd[j]);
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) + (mins[0] + mins[1])
}

/// `Σ_i w[i] · x[i]` of the weight row `row` (type `t`, `takes(t)`) and the quantized row `x`
/// of as many elements, portably.
pub fn row_dot(t: QType, row: &[u8], x: Row<'_>) -> f32 {
    let mut acc = [[0.0f32; 8]; 2];
    let mut mins = [0.0f32; 2];
    for blk in 0..x.d.len() {
        let (w, dw, mw) = codes(t, row, blk);
        let xq = &x.q[blk * QK..(blk + 1) * QK];
        let d = dw * x.d[blk];
        for (j, lane) in acc[blk % 2].iter_mut().enumerate() {
            let sum: i32 = [2 * j, 2 * j + 1, 16 + 2 * j, 17 + 2 * j]
                .iter()
                .map(|e| i32::from(w[*e]) * i32::from(xq[*e]))
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
    use super::{k_scales, Row, QK};
    use crate::cpu::quant::QType;

    /// 32 elements `c` times `id`, rounded to nearest (ties to even, the default rounding
    /// mode, as `round_ties_even`) and saturated to i16 into `q`; returns their sum.
    ///
    /// # Safety
    /// The CPU supports avx2; `c` and `q` hold 32 elements.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn codes_of(c: &[f32], id: f32, q: &mut [i16]) -> i32 {
        debug_assert!(c.len() == QK && q.len() == QK);
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

    /// Adds block `blk` (16-bit weights `w`: elements 0-15 and 16-31, scale `dw`, min `mw`,
    /// read when `MIN`) times block `blk` of each row of x. The types without a min skip a
    /// scalar multiply-add per block and row of x (`has_min`) where x has 2 rows or more
    /// (10-25% faster at 4-8 rows); one row keeps it: without it that loop ran 1.2-1.5x slower
    /// (its code laid out differently).
    #[inline(always)]
    unsafe fn block<const R: usize, const MIN: bool>(
        w: [__m256i; 2],
        dw: f32,
        mw: f32,
        blk: usize,
        x: &[Row<'_>; R],
        acc: &mut Acc<R>,
    ) {
        for (r, x) in x.iter().enumerate() {
            // block blk of row r: inside it (blk < k / 32)
            let p = x.q.as_ptr().add(QK * blk);
            let lo = _mm256_madd_epi16(w[0], _mm256_loadu_si256(p.cast()));
            let hi = _mm256_madd_epi16(w[1], _mm256_loadu_si256(p.add(16).cast()));
            // 4 products a lane: at most 4 · 32767 · 4096 (the module's bound)
            let lanes = _mm256_add_epi32(lo, hi);
            let d = _mm256_set1_ps(dw * *x.d.get_unchecked(blk));
            let scaled = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lanes));
            acc.lanes[r] = _mm256_add_ps(acc.lanes[r], scaled);
            if MIN || R == 1 {
                acc.mins[r] += mw * *x.s.get_unchecked(blk);
            }
        }
    }

    /// 32 signed bytes as 16-bit weights: elements 0-15, 16-31.
    #[inline(always)]
    unsafe fn widen(q: __m256i) -> [__m256i; 2] {
        [
            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(q)),
        ]
    }

    /// Block `blk` of a row of the 32-element block type of ggml code `T` times block `blk`
    /// of each row of x, added to `acc`.
    #[inline(always)]
    unsafe fn block32<const R: usize, const T: u32>(
        row: &[u8],
        blk: usize,
        x: &[Row<'_>; R],
        acc: &mut Acc<R>,
    ) {
        let bytes = match T {
            8 => 34,
            2 => 18,
            3 => 20,
            6 => 22,
            _ => 24,
        };
        // block blk: row[blk * bytes..(blk + 1) * bytes], inside the row
        let b = row.as_ptr().add(blk * bytes);
        if T == 2 || T == 3 {
            // the 16 bytes widened first: each 16-bit lane's low and high nibbles are elements
            // j and j + 16
            let qs = b.add(if T == 2 { 2 } else { 4 });
            let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs.cast()));
            let (lo, hi) = (
                _mm256_and_si256(v, _mm256_set1_epi16(0xF)),
                _mm256_srli_epi16::<4>(v),
            );
            if T == 2 {
                let eight = _mm256_set1_epi16(8);
                let w = [_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight)];
                block::<R, false>(w, half(b), 0.0, blk, x, acc);
            } else {
                block::<R, true>([lo, hi], half(b), half(b.add(2)), blk, x, acc);
            }
            return;
        }
        let (q, m) = match T {
            8 => (_mm256_loadu_si256(b.add(2).cast()), 0.0),
            6 => {
                let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
                let q = _mm256_or_si256(nibbles32(b.add(6)), bit4_of_each(qh));
                (_mm256_sub_epi8(q, _mm256_set1_epi8(16)), 0.0)
            }
            _ => {
                let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
                let q = _mm256_or_si256(nibbles32(b.add(8)), bit4_of_each(qh));
                (q, half(b.add(2)))
            }
        };
        if T == 7 {
            block::<R, true>(widen(q), half(b), m, blk, x, acc);
        } else {
            block::<R, false>(widen(q), half(b), m, blk, x, acc);
        }
    }

    /// A row of the 32-element block type of ggml code `T`: blocks in pairs (even, odd).
    #[inline(always)]
    unsafe fn blocks32<const R: usize, const T: u32>(
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
        acc: &mut [Acc<R>; 2],
    ) {
        let blocks = k / QK;
        let mut blk = 0;
        while blk + 1 < blocks {
            block32::<R, T>(row, blk, x, &mut acc[0]);
            block32::<R, T>(row, blk + 1, x, &mut acc[1]);
            blk += 2;
        }
        if blk < blocks {
            block32::<R, T>(row, blk, x, &mut acc[0]);
        }
    }

    /// A Q4_K or (`FIVE`) Q5_K row, a super-block (8 sub-blocks of 32) at a time.
    #[inline(always)]
    unsafe fn k_rows<const R: usize, const FIVE: bool>(
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
        acc: &mut [Acc<R>; 2],
    ) {
        let bytes = if FIVE { 176 } else { 144 };
        let nibble = _mm256_set1_epi8(0xF);
        for sb in 0..k / 256 {
            // super-block sb: row[sb * bytes..(sb + 1) * bytes], inside the row
            let b = row.as_ptr().add(sb * bytes);
            let (d, dmin) = (half(b), half(b.add(2)));
            let (scales, mins) = k_scales(std::slice::from_raw_parts(b.add(4), 12));
            let qs = b.add(if FIVE { 48 } else { 16 });
            let qh = _mm256_loadu_si256(b.add(16).cast());
            for g in 0..4 {
                if !FIVE {
                    // the 32 bytes widened first: each 16-bit lane's low nibble is sub-block
                    // 2g's element, its high nibble sub-block 2g + 1's
                    let at = |h: usize| _mm_loadu_si128(qs.add(32 * g + 16 * h).cast());
                    let v = [_mm256_cvtepu8_epi16(at(0)), _mm256_cvtepu8_epi16(at(1))];
                    let mask = _mm256_set1_epi16(0xF);
                    let lo = [_mm256_and_si256(v[0], mask), _mm256_and_si256(v[1], mask)];
                    let hi = [_mm256_srli_epi16::<4>(v[0]), _mm256_srli_epi16::<4>(v[1])];
                    for (h, w) in [lo, hi].into_iter().enumerate() {
                        let i = 2 * g + h;
                        let dl = d * scales[i] as f32;
                        let ml = -(dmin * mins[i] as f32);
                        block::<R, true>(w, dl, ml, 8 * sb + i, x, &mut acc[h]);
                    }
                    continue;
                }
                let v = _mm256_loadu_si256(qs.add(32 * g).cast());
                let halves = [
                    _mm256_and_si256(v, nibble),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble),
                ];
                for (h, mut q) in halves.into_iter().enumerate() {
                    let i = 2 * g + h;
                    if FIVE {
                        // bit i of each qh byte, as bit 4
                        let bit = _mm256_set1_epi8(1 << i);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                    let dl = d * scales[i] as f32;
                    let ml = -(dmin * mins[i] as f32);
                    block::<R, true>(widen(q), dl, ml, 8 * sb + i, x, &mut acc[h]);
                }
            }
        }
    }

    /// A Q6_K row: per super-block, half h and quarter k, 32 codes - 32 times their scale
    /// per 16 (at most 32 · 128 in magnitude: 16 bits).
    #[inline(always)]
    unsafe fn q6_k_rows<const R: usize>(
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
        acc: &mut [Acc<R>; 2],
    ) {
        let (nibble, two) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
        for sb in 0..k / 256 {
            // super-block sb: row[sb * 210..(sb + 1) * 210], inside the row
            let b = row.as_ptr().add(sb * 210);
            let (ql, qh, scales) = (b, b.add(128), b.add(192));
            let d = half(b.add(208));
            for h in 0..2 {
                let high_bits = _mm256_loadu_si256(qh.add(32 * h).cast());
                let low0 = _mm256_loadu_si256(ql.add(64 * h).cast());
                let low1 = _mm256_loadu_si256(ql.add(64 * h + 32).cast());
                let quarters = [
                    (low0, high_bits),
                    (low1, _mm256_srli_epi16::<2>(high_bits)),
                    (
                        _mm256_srli_epi16::<4>(low0),
                        _mm256_srli_epi16::<4>(high_bits),
                    ),
                    (
                        _mm256_srli_epi16::<4>(low1),
                        _mm256_srli_epi16::<6>(high_bits),
                    ),
                ];
                for (kq, (low, high)) in quarters.into_iter().enumerate() {
                    let low = _mm256_and_si256(low, nibble);
                    let high = _mm256_slli_epi16::<4>(_mm256_and_si256(high, two));
                    let q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
                    let i = 4 * h + kq;
                    let [w0, w1] = widen(q);
                    let s0 = _mm256_set1_epi16(i16::from(*scales.add(2 * i) as i8));
                    let s1 = _mm256_set1_epi16(i16::from(*scales.add(2 * i + 1) as i8));
                    let w = [_mm256_mullo_epi16(w0, s0), _mm256_mullo_epi16(w1, s1)];
                    block::<R, false>(w, d, 0.0, 8 * sb + i, x, &mut acc[kq % 2]);
                }
            }
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
        let mut acc = [Acc::<R>::zero(), Acc::<R>::zero()];
        match t {
            QType::Q8_0 => blocks32::<R, 8>(row, k, x, &mut acc),
            QType::Q4_0 => blocks32::<R, 2>(row, k, x, &mut acc),
            QType::Q4_1 => blocks32::<R, 3>(row, k, x, &mut acc),
            QType::Q5_0 => blocks32::<R, 6>(row, k, x, &mut acc),
            QType::Q5_1 => blocks32::<R, 7>(row, k, x, &mut acc),
            QType::Q4_K => k_rows::<R, false>(row, k, x, &mut acc),
            QType::Q5_K => k_rows::<R, true>(row, k, x, &mut acc),
            QType::Q6_K => q6_k_rows::<R>(row, k, x, &mut acc),
            _ => unreachable!("{} is not a quantized type", t.name()),
        }
        let mut out = [0.0; R];
        for (r, o) in out.iter_mut().enumerate() {
            let (mut e, mut d) = ([0.0f32; 8], [0.0f32; 8]);
            _mm256_storeu_ps(e.as_mut_ptr(), acc[0].lanes[r]);
            _mm256_storeu_ps(d.as_mut_ptr(), acc[1].lanes[r]);
            *o = super::total(e, d, [acc[0].mins[r], acc[1].mins[r]]);
        }
        out
    }
}
