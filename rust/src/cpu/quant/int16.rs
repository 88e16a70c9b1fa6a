//! The decode path's integer products with 16-bit activations, for every quantized type (Q8_0,
//! Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): each row of x is quantized once per call to
//! 16-bit codes with an f32 scale per 32 elements (`QuantizedRows`: x ≈ d·q, |q| <= 32767, an
//! error of at most d / 2 = max |x| / 65534 of the block, 258 times finer than 8-bit codes), the
//! weights are widened to 16-bit integers in registers and multiplied with `madd` (AVX2's
//! `vpmaddwd`: 16 products a multiply-add, summed in pairs to 32-bit lanes).
//!
//! A row is cut into units of one weight scale and one x scale: the 32-element blocks (and
//! Q4_K / Q5_K sub-blocks), Q6_K's halves of 16 (its 8-bit scale per 16 kept out of the
//! codes). Each unit's integer products are summed whole, exactly, in 32 bits (at most
//! 32 · 32767 · 128 < 2^28 for Q8_0, 32 · 32767 · 31 for the 4- and 5-bit codes, 16 · 32 · 32767
//! for Q6_K; `madd`'s one overflow, two products of -32768 · -32768, cannot happen: x's codes
//! stop at -32767), converted to f32 once and scaled by `d_w·d_x`: unit u adds
//! `(d_w·d_x) · S_u` to f32 lane u % 8 (plus `m_w · d_x·Σ q_x` to mins lane u % 8 for the types
//! with a min: Q4_1, Q5_1 and the Q4_K / Q5_K sub-blocks), and the lanes are summed in one
//! fixed order at the end. AVX2 sums 8 units at a time to one vector of 8 sums in registers
//! (a tree of `vphaddd`), so a convert, a scale product and an add serve 8 units; the portable
//! path (`row_dot`) takes the same steps one unit at a time, bit for bit the same.
use super::formats::{f16_to_f32, five_bits, QType, QK_K};

/// Elements per block of x (and per block or sub-block of every type taken here).
const QK: usize = 32;

/// Whether the integer path takes rows of this type (F32 / F16 / BF16 keep the f32 path).
pub fn takes(t: QType) -> bool {
    !matches!(t, QType::F32 | QType::F16 | QType::BF16)
}

/// Rows of x `[m, k]` as blocks of 32 codes `q` in -32767..=32767 with the scale `d` = max |x|
/// / 32767 of the block (x ≈ d·q, rounded to nearest, ties to even), and `s` = d · Σ q (what a
/// min multiplies); a block under ~4e-34 in magnitude has codes of 0.
pub type QuantizedRows = super::quantize::QuantizedRows<i16>;

/// One row of `QuantizedRows`.
pub type Row<'a> = super::quantize::Row<'a, i16>;

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
/// (element order), the scales of its halves (elements 0-15 and 16-31: equal but for Q6_K,
/// whose 8-bit scale per 16 they carry) and its min: the weight is `dl[h]·w + m`.
pub(super) fn codes(t: QType, row: &[u8], blk: usize) -> ([i16; QK], [f32; 2], f32) {
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
                *v = i16::from(low | (high << 4)) - 32;
            }
            let d = half(b, 208);
            let dl = |j: usize| d * f32::from(scales[2 * i + j] as i8);
            return (q, [dl(0), dl(1)], 0.0);
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
        let dl = half(b, 0) * f32::from(scales[i]);
        return (q, [dl; 2], -(half(b, 2) * f32::from(mins[i])));
    }
    let b = &row[blk * bytes..(blk + 1) * bytes];
    let (d, m) = match t {
        QType::Q8_0 => {
            for (q, v) in q.iter_mut().zip(&b[2..34]) {
                *q = i16::from(*v as i8);
            }
            (half(b, 0), 0.0)
        }
        QType::Q4_0 | QType::Q4_1 => {
            let (qs, offset) = if t == QType::Q4_0 { (2, 8) } else { (4, 0) };
            for (j, v) in b[qs..qs + 16].iter().enumerate() {
                q[j] = i16::from(v & 0xF) - offset;
                q[j + 16] = i16::from(v >> 4) - offset;
            }
            let m = if t == QType::Q4_1 { half(b, 2) } else { 0.0 };
            (half(b, 0), m)
        }
        QType::Q5_0 | QType::Q5_1 => {
            let (h, offset) = if t == QType::Q5_0 { (2, 16) } else { (4, 0) };
            let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
            for (j, v) in q.iter_mut().enumerate() {
                *v = i16::from(five_bits(&b[h + 4..h + 20], qh, j)) - offset;
            }
            let m = if t == QType::Q5_1 { half(b, 2) } else { 0.0 };
            (half(b, 0), m)
        }
        _ => unreachable!("{} is not a quantized type", t.name()),
    };
    (q, [d; 2], m)
}

/// Whether the weights of type `t` are `d·w + m` (a min per block or sub-block); the others
/// add no mins (their lanes stay +0).
fn has_min(t: QType) -> bool {
    matches!(t, QType::Q4_1 | QType::Q5_1 | QType::Q4_K | QType::Q5_K)
}

/// Eight lanes summed in the order of a tree over lanes 0 + 4, 2 + 6, 1 + 5, 3 + 7.
#[inline(always)]
pub(super) fn fold(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// `Σ_i w[i] · x[i]` of the weight row `row` (type `t`, `takes(t)`) and the quantized row `x`
/// of as many elements, portably: unit by unit as `row_dots_avx2` sums them 8 at a time.
pub fn row_dot(t: QType, row: &[u8], x: Row<'_>) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    // Q6_K's units are halves of 16 (unit 2·blk + h), the others' whole blocks
    let halves = t == QType::Q6_K;
    for blk in 0..x.d.len() {
        let (w, dl, m) = codes(t, row, blk);
        let xq = &x.q[blk * QK..(blk + 1) * QK];
        let dot = |from: usize, to: usize| -> i32 {
            (from..to).map(|e| i32::from(w[e]) * i32::from(xq[e])).sum()
        };
        if halves {
            for h in 0..2 {
                let sum = dot(16 * h, 16 * h + 16);
                acc[(2 * blk + h) % 8] += dl[h] * x.d[blk] * sum as f32;
            }
        } else {
            acc[blk % 8] += dl[0] * x.d[blk] * dot(0, QK) as f32;
        }
        if has_min(t) {
            mins[blk % 8] += m * x.s[blk];
        }
    }
    fold(acc) + fold(mins)
}

#[cfg(target_arch = "x86_64")]
pub use avx2::row_dots_avx2;

/// No closures below: a closure does not take its caller's target features, and LLVM may
/// leave it (and the intrinsics in it) out of line; helpers are `#[inline(always)]` functions.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    use super::super::dot_avx2::{bit4_of_each, half, nibbles32};
    use super::{Row, QK};
    use crate::cpu::quant::QType;

    /// Per row of x: the 8 f32 lanes of scaled unit sums and the 8 lanes of mins.
    pub(in crate::cpu::quant) struct Lanes<const R: usize> {
        pub(in crate::cpu::quant) acc: [__m256; R],
        pub(in crate::cpu::quant) mins: [__m256; R],
    }

    impl<const R: usize> Lanes<R> {
        /// Each row's result: its lanes and its mins' lanes, each summed in `fold`'s order.
        #[inline(always)]
        pub(in crate::cpu::quant) unsafe fn totals(&self) -> [f32; R] {
            let mut out = [0.0; R];
            for (r, o) in out.iter_mut().enumerate() {
                let (mut a, mut m) = ([0.0f32; 8], [0.0f32; 8]);
                _mm256_storeu_ps(a.as_mut_ptr(), self.acc[r]);
                _mm256_storeu_ps(m.as_mut_ptr(), self.mins[r]);
                *o = super::fold(a) + super::fold(m);
            }
            out
        }
    }

    /// The 8 i32 lanes of the 16-bit weights `w` (elements 0-15, 16-31) times block `blk` of
    /// each row of x (inside it: blk < k / 32).
    #[inline(always)]
    unsafe fn dots<const R: usize>(w: [__m256i; 2], x: &[Row<'_>; R], blk: usize) -> [__m256i; R] {
        let mut out = [_mm256_setzero_si256(); R];
        for (o, x) in out.iter_mut().zip(x) {
            let p = x.q.as_ptr().add(QK * blk);
            let lo = _mm256_madd_epi16(w[0], _mm256_loadu_si256(p.cast()));
            let hi = _mm256_madd_epi16(w[1], _mm256_loadu_si256(p.add(16).cast()));
            *o = _mm256_add_epi32(lo, hi);
        }
        out
    }

    /// Two halves of 16: the 8 i32 lanes of `w[0]` times elements 0-15 of block `blk` of each
    /// row of x, and of `w[1]` times elements 16-31 (Q6_K's units).
    #[inline(always)]
    unsafe fn half_dots<const R: usize>(
        w: [__m256i; 2],
        x: &[Row<'_>; R],
        blk: usize,
    ) -> [[__m256i; R]; 2] {
        let mut out = [[_mm256_setzero_si256(); R]; 2];
        for (r, x) in x.iter().enumerate() {
            let p = x.q.as_ptr().add(QK * blk);
            out[0][r] = _mm256_madd_epi16(w[0], _mm256_loadu_si256(p.cast()));
            out[1][r] = _mm256_madd_epi16(w[1], _mm256_loadu_si256(p.add(16).cast()));
        }
        out
    }

    /// Per row, `vphaddd` of two units' lanes (or of two such pairs).
    #[inline(always)]
    unsafe fn hadd<const R: usize>(a: [__m256i; R], b: [__m256i; R]) -> [__m256i; R] {
        let mut out = a;
        for (o, b) in out.iter_mut().zip(b) {
            *o = _mm256_hadd_epi32(*o, b);
        }
        out
    }

    /// Per row, 8 units' sums in order (lane u: unit u) from `hadd(hadd(0, 1), hadd(2, 3))`
    /// (per 128-bit half: units 0-3's sums of lanes 0-3, low, and 4-7, high) and the same of
    /// units 4-7.
    #[inline(always)]
    unsafe fn finish<const R: usize>(g0: [__m256i; R], g1: [__m256i; R]) -> [__m256i; R] {
        let mut out = g0;
        for (o, g1) in out.iter_mut().zip(g1) {
            let lo = _mm256_permute2x128_si256::<0x20>(*o, g1);
            let hi = _mm256_permute2x128_si256::<0x31>(*o, g1);
            *o = _mm256_add_epi32(lo, hi);
        }
        out
    }

    /// Adds `c[r] · S[r]` to each row's lanes: `s` the 8 units' integer sums, `c` their scale
    /// products `d_w·d_x`.
    #[inline(always)]
    pub(in crate::cpu::quant) unsafe fn add<const R: usize>(
        s: [__m256i; R],
        c: [__m256; R],
        lanes: &mut [__m256; R],
    ) {
        for ((l, s), c) in lanes.iter_mut().zip(s).zip(c) {
            *l = _mm256_add_ps(*l, _mm256_mul_ps(c, _mm256_cvtepi32_ps(s)));
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

    /// The block at `b` of the 32-element block type of ggml code `T` as 16-bit weights.
    #[inline(always)]
    unsafe fn weights32<const T: u32>(b: *const u8) -> [__m256i; 2] {
        match T {
            2 | 3 => {
                // the 16 bytes widened first: each 16-bit lane's low and high nibbles are
                // elements j and j + 16
                let qs = b.add(if T == 2 { 2 } else { 4 });
                let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs.cast()));
                let lo = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
                let hi = _mm256_srli_epi16::<4>(v);
                if T == 2 {
                    let eight = _mm256_set1_epi16(8);
                    [_mm256_sub_epi16(lo, eight), _mm256_sub_epi16(hi, eight)]
                } else {
                    [lo, hi]
                }
            }
            8 => widen(_mm256_loadu_si256(b.add(2).cast())),
            6 => {
                let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
                q5_0_weights(qh, b.add(6))
            }
            _ => {
                let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
                widen(_mm256_or_si256(nibbles32(b.add(8)), bit4_of_each(qh)))
            }
        }
    }

    /// A Q5_0 block's 16-bit weights from its qh (bit j: element j's bit 4) and its 16 bytes
    /// of nibbles at `qs`.
    #[inline(always)]
    unsafe fn q5_0_weights(qh: u32, qs: *const u8) -> [__m256i; 2] {
        let q = _mm256_or_si256(nibbles32(qs), bit4_of_each(qh));
        widen(_mm256_sub_epi8(q, _mm256_set1_epi8(16)))
    }

    /// Bytes per block of the 32-element block type of ggml code `T`.
    pub(in crate::cpu::quant) const fn bytes32(t: u32) -> usize {
        match t {
            8 => 34,
            2 => 18,
            3 => 20,
            6 => 22,
            _ => 24,
        }
    }

    /// The f16 at byte `at` of blocks `0..n` from `b` (`stride` bytes apart) as f32, 0 past n.
    #[inline(always)]
    pub(in crate::cpu::quant) unsafe fn f16s(
        b: *const u8,
        stride: usize,
        at: usize,
        n: usize,
    ) -> __m256 {
        let mut h = [0i16; 8];
        for (j, h) in h.iter_mut().enumerate().take(n) {
            *h = b.add(j * stride + at).cast::<i16>().read_unaligned();
        }
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()))
    }

    /// Elements `at..at + n` of `v` (`n` <= 8), 0 past n.
    #[inline(always)]
    pub(in crate::cpu::quant) unsafe fn load8(v: &[f32], at: usize, n: usize) -> __m256 {
        if n == 8 {
            return _mm256_loadu_ps(v.as_ptr().add(at));
        }
        let valid = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        _mm256_maskload_ps(v.as_ptr().add(at), valid)
    }

    /// Blocks `blk0..blk0 + n` (`n` <= 8) of a row of the 32-element block type of ggml code
    /// `T` times the same blocks of each row of x, added to `lanes` (the missing units of a
    /// last group add +0).
    #[inline(always)]
    unsafe fn group32<const R: usize, const T: u32>(
        row: &[u8],
        blk0: usize,
        n: usize,
        x: &[Row<'_>; R],
        lanes: &mut Lanes<R>,
    ) {
        let bytes = bytes32(T);
        // blocks blk0..blk0 + n: inside the row
        let b = row.as_ptr().add(blk0 * bytes);
        let mut g = [[_mm256_setzero_si256(); R]; 2];
        for (q, g) in g.iter_mut().enumerate() {
            let mut h = [[_mm256_setzero_si256(); R]; 2];
            for (p, h) in h.iter_mut().enumerate() {
                let j = 4 * q + 2 * p;
                let mut u = [[_mm256_setzero_si256(); R]; 2];
                for (i, u) in u.iter_mut().enumerate() {
                    if j + i < n {
                        let w = weights32::<T>(b.add((j + i) * bytes));
                        *u = dots(w, x, blk0 + j + i);
                    }
                }
                *h = hadd(u[0], u[1]);
            }
            *g = hadd(h[0], h[1]);
        }
        let s = finish(g[0], g[1]);
        let dw = f16s(b, bytes, 0, n);
        let mut c = [dw; R];
        for (c, x) in c.iter_mut().zip(x) {
            *c = _mm256_mul_ps(dw, load8(x.d, blk0, n));
        }
        add(s, c, &mut lanes.acc);
        if T == 3 || T == 7 {
            let mw = f16s(b, bytes, 2, n);
            for (m, x) in lanes.mins.iter_mut().zip(x) {
                *m = _mm256_add_ps(*m, _mm256_mul_ps(mw, load8(x.s, blk0, n)));
            }
        }
    }

    /// A row of the 32-element block type of ggml code `T`, 8 blocks at a time.
    #[inline(always)]
    unsafe fn rows32<const R: usize, const T: u32>(
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
        lanes: &mut Lanes<R>,
    ) {
        let blocks = k / QK;
        let mut blk = 0;
        while blk + 8 <= blocks {
            group32::<R, T>(row, blk, 8, x, lanes);
            blk += 8;
        }
        if blk < blocks {
            group32::<R, T>(row, blk, blocks - blk, x, lanes);
        }
    }

    /// `k_scales` of the 12 bytes at `s` as f32 (scales, mins), in registers rather than by
    /// scalar shifts into byte arrays read back through memory, per super-block and weight row
    /// (the 0.73 B Llama's Q4_K_M decode 1.06x faster, benches/RESULTS.md round 13). Lanes 0 / 1 of `v` (bytes 0-3, 4-7) hold the low 6 bits of scales / mins
    /// 0-3 and, in each byte's top 2 bits, bits 4-5 of scales / mins 4-7; lane 2 (bytes 8-11)
    /// their low 4 bits, scales' in the low nibbles, mins' in the high ones.
    ///
    /// # Safety
    /// AVX2; 16 bytes readable at `s` (a K-quant super-block's scales are followed by its codes).
    #[inline(always)]
    pub(in crate::cpu::quant) unsafe fn k_scale_floats(s: *const u8) -> (__m256, __m256) {
        let v = _mm_loadu_si128(s.cast());
        let low6 = _mm_and_si128(v, _mm_set1_epi8(0x3F));
        let top2 = _mm_slli_epi32::<4>(_mm_and_si128(_mm_srli_epi32::<6>(v), _mm_set1_epi8(3)));
        // lane 2 into lanes 0 and 1, the mins' nibbles shifted down in lane 1
        let c = _mm_srlv_epi32(
            _mm_shuffle_epi32::<0b1010_1010>(v),
            _mm_setr_epi32(0, 4, 0, 0),
        );
        let high = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi8(0xF)), top2);
        // bytes 0-7 the 8 scales, 8-15 the 8 mins
        let both = _mm_unpacklo_epi32(low6, high);
        let floats = |b: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        (floats(both), floats(_mm_srli_si128::<8>(both)))
    }

    /// A Q4_K / Q5_K super-block's factors (at `b`: d, dmin, then the packed scales): its 8
    /// sub-blocks' `d * scale` and `-(dmin * min)`, the lanes the `k_rows` kernels multiply
    /// their unit sums and x's sub-block sums by.
    ///
    /// # Safety
    /// AVX2 and F16C; `b` a super-block (its scales followed by its codes: `k_scale_floats`).
    #[inline(always)]
    pub(in crate::cpu::quant) unsafe fn k_factors(b: *const u8) -> (__m256, __m256) {
        let (scales, mins) = k_scale_floats(b.add(4));
        let dl = _mm256_mul_ps(_mm256_set1_ps(half(b)), scales);
        let ml = _mm256_mul_ps(_mm256_set1_ps(half(b.add(2))), mins);
        (dl, _mm256_xor_ps(ml, _mm256_set1_ps(-0.0)))
    }

    /// Sub-blocks 2g and 2g + 1 of a Q4_K super-block (quants at `qs`) or (`FIVE`) a Q5_K one
    /// (`qh` its high bits) as 16-bit weights.
    #[inline(always)]
    unsafe fn k_weights<const FIVE: bool>(
        qs: *const u8,
        qh: __m256i,
        g: usize,
    ) -> [[__m256i; 2]; 2] {
        if FIVE {
            let nibble = _mm256_set1_epi8(0xF);
            let v = _mm256_loadu_si256(qs.add(32 * g).cast());
            let halves = [
                _mm256_and_si256(v, nibble),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble),
            ];
            let mut w = [[_mm256_setzero_si256(); 2]; 2];
            for (h, (w, q)) in w.iter_mut().zip(halves).enumerate() {
                // bit 2g + h of each qh byte, as bit 4
                let bit = _mm256_set1_epi8(1 << (2 * g + h));
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                let high = _mm256_and_si256(set, _mm256_set1_epi8(16));
                *w = widen(_mm256_or_si256(q, high));
            }
            return w;
        }
        // the 32 bytes widened first: each 16-bit lane's low nibble is sub-block 2g's
        // element, its high nibble sub-block 2g + 1's
        let mask = _mm256_set1_epi16(0xF);
        let v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs.add(32 * g).cast()));
        let v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(qs.add(32 * g + 16).cast()));
        [
            [_mm256_and_si256(v0, mask), _mm256_and_si256(v1, mask)],
            [_mm256_srli_epi16::<4>(v0), _mm256_srli_epi16::<4>(v1)],
        ]
    }

    /// A Q4_K or (`FIVE`) Q5_K row, a super-block (8 sub-blocks of 32: 8 units) at a time.
    #[inline(always)]
    unsafe fn k_rows<const R: usize, const FIVE: bool>(
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
        lanes: &mut Lanes<R>,
    ) {
        let bytes = if FIVE { 176 } else { 144 };
        for sb in 0..k / 256 {
            // super-block sb: row[sb * bytes..(sb + 1) * bytes], inside the row
            let b = row.as_ptr().add(sb * bytes);
            let (dl, ml) = k_factors(b);
            let qs = b.add(if FIVE { 48 } else { 16 });
            let qh = _mm256_loadu_si256(b.add(16).cast());
            let blk0 = 8 * sb;
            let mut g = [[_mm256_setzero_si256(); R]; 2];
            for (q, g) in g.iter_mut().enumerate() {
                let mut h = [[_mm256_setzero_si256(); R]; 2];
                for (p, h) in h.iter_mut().enumerate() {
                    let pair = 2 * q + p;
                    let w = k_weights::<FIVE>(qs, qh, pair);
                    let a = dots(w[0], x, blk0 + 2 * pair);
                    let c = dots(w[1], x, blk0 + 2 * pair + 1);
                    *h = hadd(a, c);
                }
                *g = hadd(h[0], h[1]);
            }
            let s = finish(g[0], g[1]);
            let mut c = [dl; R];
            for (c, x) in c.iter_mut().zip(x) {
                *c = _mm256_mul_ps(dl, _mm256_loadu_ps(x.d.as_ptr().add(blk0)));
            }
            add(s, c, &mut lanes.acc);
            for (m, x) in lanes.mins.iter_mut().zip(x) {
                let s = _mm256_loadu_ps(x.s.as_ptr().add(blk0));
                *m = _mm256_add_ps(*m, _mm256_mul_ps(ml, s));
            }
        }
    }

    /// Half h of a Q6_K super-block (`ql` its low nibbles, `qh` its high bits): its four
    /// quarters' 32 codes - 32 each, quarter kq being sub-block 4h + kq.
    #[inline(always)]
    unsafe fn q6_k_half(ql: *const u8, qh: *const u8, h: usize) -> [__m256i; 4] {
        let (nibble, two) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
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
        // a loop, not `map`: a closure would not be inlined with the caller's target features
        let mut codes = [_mm256_setzero_si256(); 4];
        for (c, (low, high)) in codes.iter_mut().zip(quarters) {
            let low = _mm256_and_si256(low, nibble);
            let high = _mm256_slli_epi16::<4>(_mm256_and_si256(high, two));
            *c = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
        }
        codes
    }

    /// A Q6_K row: per super-block, half h (4 sub-blocks of 32: 8 units of 16) and quarter
    /// kq, 32 codes - 32; their 8-bit scales per 16 go with `d` into the units' scales.
    #[inline(always)]
    unsafe fn q6_k_rows<const R: usize>(
        row: &[u8],
        k: usize,
        x: &[Row<'_>; R],
        lanes: &mut Lanes<R>,
    ) {
        // x's scale of each sub-block, for both its units
        let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        for sb in 0..k / 256 {
            // super-block sb: row[sb * 210..(sb + 1) * 210], inside the row
            let b = row.as_ptr().add(sb * 210);
            let (ql, qh, scales) = (b, b.add(128), b.add(192));
            let d = _mm256_set1_ps(half(b.add(208)));
            for h in 0..2 {
                let codes = q6_k_half(ql, qh, h);
                let blk0 = 8 * sb + 4 * h;
                let mut g = [[_mm256_setzero_si256(); R]; 2];
                for (q, g) in g.iter_mut().enumerate() {
                    let mut hs = [[_mm256_setzero_si256(); R]; 2];
                    for (p, hs) in hs.iter_mut().enumerate() {
                        let kq = 2 * q + p;
                        let u = half_dots(widen(codes[kq]), x, blk0 + kq);
                        *hs = hadd(u[0], u[1]);
                    }
                    *g = hadd(hs[0], hs[1]);
                }
                let s = finish(g[0], g[1]);
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    scales.add(8 * h).cast(),
                )));
                let dl = _mm256_mul_ps(d, sc);
                let mut c = [dl; R];
                for (c, x) in c.iter_mut().zip(x) {
                    let v = _mm_loadu_ps(x.d.as_ptr().add(blk0));
                    let dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), pairs);
                    *c = _mm256_mul_ps(dl, dx);
                }
                add(s, c, &mut lanes.acc);
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
        let mut lanes = Lanes {
            acc: [_mm256_setzero_ps(); R],
            mins: [_mm256_setzero_ps(); R],
        };
        match t {
            QType::Q8_0 => rows32::<R, 8>(row, k, x, &mut lanes),
            QType::Q4_0 => rows32::<R, 2>(row, k, x, &mut lanes),
            QType::Q4_1 => rows32::<R, 3>(row, k, x, &mut lanes),
            QType::Q5_0 => rows32::<R, 6>(row, k, x, &mut lanes),
            QType::Q5_1 => rows32::<R, 7>(row, k, x, &mut lanes),
            QType::Q4_K => k_rows::<R, false>(row, k, x, &mut lanes),
            QType::Q5_K => k_rows::<R, true>(row, k, x, &mut lanes),
            QType::Q6_K => q6_k_rows::<R>(row, k, x, &mut lanes),
            _ => unreachable!("{} is not a quantized type", t.name()),
        }
        lanes.totals()
    }

    /// A row of type `t` (`takes(t)`, `q.len()` elements) as its 16-bit codes in element order
    /// (`codes`' per block, whole blocks of 32 and super-blocks of 256 a time): the integer
    /// panels' widening (`gemm16`), the same values as the portable loop.
    ///
    /// # Safety
    /// The CPU supports avx2, fma and f16c; `row` holds `q.len()` elements of `t`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::cpu::quant) unsafe fn row_codes(t: QType, row: &[u8], q: &mut [i16]) {
        match t {
            QType::Q8_0 => blocks_codes::<8>(row, q),
            QType::Q4_0 => blocks_codes::<2>(row, q),
            QType::Q4_1 => blocks_codes::<3>(row, q),
            QType::Q5_0 => blocks_codes::<6>(row, q),
            QType::Q5_1 => blocks_codes::<7>(row, q),
            QType::Q4_K => k_codes::<false>(row, q),
            QType::Q5_K => k_codes::<true>(row, q),
            QType::Q6_K => q6_k_codes(row, q),
            t if crate::cpu::quant::repack::repacked(t) => repacked_codes(t, row, q),
            _ => unreachable!("{} is not a quantized type", t.name()),
        }
    }

    /// `row_codes` for a repacked row (`repack`'s groups of up to 8 blocks: the scales, for
    /// Q5_0 the qh halves, then each block's codes), read in place: the codes of the plain
    /// type's blocks (`weights32`), nothing converted back first.
    #[inline(always)]
    unsafe fn repacked_codes(t: QType, row: &[u8], q: &mut [i16]) {
        use crate::cpu::quant::repack::{self, GROUP};
        let plain = repack::read_as(t);
        let (block, payload) = match plain {
            QType::Q4_0 => (18, 16),
            QType::Q5_0 => (22, 16),
            QType::Q8_0 => (34, 32),
            QType::Q4_1 => (20, 16),
            _ => unreachable!("{} has no repacked layout", t.name()),
        };
        // a group's bytes per block before its codes (scale, qh halves)
        let head = block - payload;
        let blocks = q.len() / QK;
        assert!(row.len() >= blocks * block);
        // full Q8_0R / Q5_0R groups on AVX-512's permutes where it is granted
        let wide = matches!(plain, QType::Q8_0 | QType::Q5_0) && crate::cpu::quant::vnni();
        let mut blk0 = 0;
        while blk0 < blocks {
            // a group of n blocks from blk0 (the row's last the rest): inside the row
            let n = (blocks - blk0).min(GROUP);
            let g = row.as_ptr().add(blk0 * block);
            if wide && n == GROUP {
                // SAFETY: AVX-512 granted (`vnni()`); a full group, its 256 codes inside q
                let out = q.as_mut_ptr().add(QK * blk0);
                crate::cpu::quant::q8_0r::group_codes(g, plain == QType::Q5_0, out);
                blk0 += n;
                continue;
            }
            if plain == QType::Q8_0 && n == GROUP {
                // a full Q8_0R group's codes are its blocks' 4-byte words transposed
                // (`repack::transpose_words`): 8 loads of word j of each block, transposed back
                let mut words = [_mm256_setzero_si256(); 8];
                for (j, w) in words.iter_mut().enumerate() {
                    *w = _mm256_loadu_si256(g.add(2 * n + 32 * j).cast());
                }
                for (j, q32) in transpose8(words).into_iter().enumerate() {
                    store32(q, blk0 + j, widen(q32));
                }
                blk0 += n;
                continue;
            }
            if plain == QType::Q5_0 && n == GROUP {
                // a full Q5_0R group's masks and transposed words: its plain blocks back first
                let mut blocks = [0u8; GROUP * 22];
                repack::blocks(t, &row[blk0 * block..(blk0 + n) * block], &mut blocks);
                for j in 0..n {
                    store32(q, blk0 + j, weights32::<6>(blocks.as_ptr().add(22 * j)));
                }
                blk0 += n;
                continue;
            }
            for j in 0..n {
                // block j's codes; the plain block keeps them 2 bytes in (Q4_0, Q8_0: after
                // the scale, where `weights32` reads them)
                let qs = g.add(head * n + payload * j);
                let w = match plain {
                    QType::Q5_0 => {
                        let lo = g.add(2 * n + 2 * j).cast::<u16>().read_unaligned();
                        let hi = g.add(4 * n + 2 * j).cast::<u16>().read_unaligned();
                        q5_0_weights(u32::from(lo) | (u32::from(hi) << 16), qs)
                    }
                    QType::Q8_0 => weights32::<8>(qs.sub(2)),
                    QType::Q4_1 => weights32::<3>(qs.sub(4)),
                    _ => weights32::<2>(qs.sub(2)),
                };
                store32(q, blk0 + j, w);
            }
            blk0 += n;
        }
    }

    /// The 8 x 8 matrix of 32-bit lanes `r` (row i: `r[i]`) transposed: lane i of `out[c]` is
    /// lane c of `r[i]`.
    #[inline(always)]
    unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
        let mut t = [_mm256_setzero_si256(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // u[4h + c]: lanes c (and c + 4 in the high half) of rows 4h..4h + 4
        let mut u = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            let (a, b, c, d) = (t[4 * h], t[4 * h + 1], t[4 * h + 2], t[4 * h + 3]);
            u[4 * h] = _mm256_unpacklo_epi64(a, c);
            u[4 * h + 1] = _mm256_unpackhi_epi64(a, c);
            u[4 * h + 2] = _mm256_unpacklo_epi64(b, d);
            u[4 * h + 3] = _mm256_unpackhi_epi64(b, d);
        }
        let mut out = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            out[c] = _mm256_permute2x128_si256::<0x20>(u[c], u[4 + c]);
            out[c + 4] = _mm256_permute2x128_si256::<0x31>(u[c], u[4 + c]);
        }
        out
    }

    /// Stores the 16-bit weights `w` (elements 0-15, 16-31) as block `blk` of `q`.
    #[inline(always)]
    unsafe fn store32(q: &mut [i16], blk: usize, w: [__m256i; 2]) {
        debug_assert!(q.len() >= QK * (blk + 1));
        let at = q.as_mut_ptr().add(QK * blk).cast::<__m256i>();
        _mm256_storeu_si256(at, w[0]);
        _mm256_storeu_si256(at.add(1), w[1]);
    }

    /// `row_codes` for the 32-element block type of ggml code `T`.
    #[inline(always)]
    unsafe fn blocks_codes<const T: u32>(row: &[u8], q: &mut [i16]) {
        let bytes = bytes32(T);
        assert!(row.len() >= q.len() / QK * bytes);
        for blk in 0..q.len() / QK {
            store32(q, blk, weights32::<T>(row.as_ptr().add(blk * bytes)));
        }
    }

    /// `row_codes` for Q4_K or (`FIVE`) Q5_K.
    #[inline(always)]
    unsafe fn k_codes<const FIVE: bool>(row: &[u8], q: &mut [i16]) {
        let bytes = if FIVE { 176 } else { 144 };
        assert!(row.len() >= q.len() / 256 * bytes);
        for sb in 0..q.len() / 256 {
            let b = row.as_ptr().add(sb * bytes);
            let qs = b.add(if FIVE { 48 } else { 16 });
            let qh = _mm256_loadu_si256(b.add(16).cast());
            for g in 0..4 {
                let w = k_weights::<FIVE>(qs, qh, g);
                store32(q, 8 * sb + 2 * g, w[0]);
                store32(q, 8 * sb + 2 * g + 1, w[1]);
            }
        }
    }

    /// `row_codes` for Q6_K: codes - 32, quarter kq of half h being sub-block 4h + kq.
    #[inline(always)]
    unsafe fn q6_k_codes(row: &[u8], q: &mut [i16]) {
        assert!(row.len() >= q.len() / 256 * 210);
        for sb in 0..q.len() / 256 {
            let b = row.as_ptr().add(sb * 210);
            let (ql, qh) = (b, b.add(128));
            for h in 0..2 {
                for (kq, c) in q6_k_half(ql, qh, h).into_iter().enumerate() {
                    store32(q, 8 * sb + 4 * h + kq, widen(c));
                }
            }
        }
    }
}
