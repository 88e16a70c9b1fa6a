//! The multi-row (above `DECODE_MAX_ROWS`: batched decode, prefill) products with 16-bit
//! activations, in integers, for every quantized type: a panel of `PANEL` weight rows is widened
//! once to 16-bit codes laid out for `vpmaddwd` (`pack`: pairs of adjacent k of the 16 rows side
//! by side, `[k / 2, PANEL]` 32-bit pairs, the rows' scales per unit and mins per 32 elements)
//! and every row of x (its 16-bit codes per 32 elements, `int16`'s `QuantizedRows`) passes over
//! it, a few rows a register tile. One `madd` does 16 multiply-adds where an f32 FMA does 8
//! (AVX-512 VNNI's `vpdpwssd` 32, the add included), and the weights are widened, not
//! dequantized to f32. A unit is a block of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the Q4_K / Q5_K
//! sub-blocks), or a half of 16 in a panel with a Q6_K row (its 8-bit scale per 16 kept out of
//! the codes, whose sums would not fit 32 bits with it).
//!
//! Each unit's products are summed exactly in 32 bits (at most 32 · 32767 · 128 < 2^28; the
//! K-quants' scales stay out of the codes, in the unit's scale), converted to f32 once and
//! added as `acc = fma(S, d_w · d_x, acc)`, then after each block, in a panel with any min,
//! `acc = fma(m_w, s_x, acc)` (`s_x` = d_x · Σ q_x), in order: the portable path
//! (`product_portable`), the AVX2 one and the VNNI one give the same bits.
use super::formats::{f16_to_f32, five_bits, QType, QK_K};
use super::int16::QuantizedRows;
use super::matmul::transpose_into_panel;
use super::repack;
use crate::cpu::linear::PANEL;

/// Elements per block (of x and of the types taken).
const QK: usize = 32;
/// Rows of x per register tile: 2 f32 and 2 i32 accumulators a row, 2 weight registers and
/// the broadcast within the 16 AVX registers.
const TILE: usize = 3;

/// Whether the integer panels take rows of this type.
pub(super) fn takes(t: QType) -> bool {
    matches!(
        t,
        QType::Q8_0
            | QType::Q4_0
            | QType::Q4_1
            | QType::Q5_0
            | QType::Q5_1
            | QType::Q4_K
            | QType::Q5_K
            | QType::Q6_K
    )
}

/// One thread's panel: `codes` `[k / 2, PANEL]` pairs of 16-bit codes (held as f32 bits so
/// that `transpose_into_panel` moves them), `scales` `[k / 32, PANEL]`, and the row-major
/// codes before the transpose.
#[derive(Default)]
pub(super) struct Panel {
    codes: Vec<f32>,
    scales: Vec<f32>,
    /// Whether the units are halves of 16 (a row of the panel is Q6_K: a scale per 16) or
    /// whole blocks of 32.
    halves: bool,
    /// `[k / 32, PANEL]`: each block's min (the weight is `scale · code + min`), or empty where
    /// no row of the panel has one.
    mins: Vec<f32>,
    staging: Vec<f32>,
    /// A row's scales and mins per 32 elements.
    row_scales: Vec<f32>,
    row_mins: Vec<f32>,
}

/// The f16 at byte `at` of `b` as f32.
#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// A row `row` of a type taken (`q.len()` elements) as its codes into `q`, each 16 elements'
/// scale into `d` and each 32 elements' min into `m`: element e's weight is
/// `d[e / 16] · q[e] + m[e / 32]` (the two scales of a block equal but for Q6_K's; the mins 0
/// for the types without).
fn widen_row(t: QType, row: &[u8], q: &mut [i16], d: &mut [f32], m: &mut [f32]) {
    let bytes = t.block().1;
    if repack::repacked(t) {
        // a group at a time as the plain type's blocks, on the stack (no read-back of the row)
        let mut plain = [0u8; repack::GROUP * 34]; // Q8_0 blocks, the largest kept
        for (g, src) in row.chunks(repack::GROUP * bytes).enumerate() {
            let (b0, n) = (g * repack::GROUP, src.len() / bytes);
            let blocks = &mut plain[..src.len()];
            repack::blocks(t, src, blocks);
            let (q, d) = (&mut q[QK * b0..QK * (b0 + n)], &mut d[2 * b0..2 * (b0 + n)]);
            widen_row(repack::read_as(t), blocks, q, d, &mut m[b0..b0 + n]);
        }
        return;
    }
    if t == QType::Q6_K {
        for (sb, b) in row.chunks_exact(bytes).enumerate() {
            let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
            let dd = half(b, 208);
            for i in 0..8 {
                let blk = 8 * sb + i;
                let (h, kq) = (i / 4, i % 4);
                let dst = &mut q[QK * blk..QK * (blk + 1)];
                for (l, v) in dst.iter_mut().enumerate() {
                    let low = (ql[64 * h + 32 * (kq % 2) + l] >> (4 * (kq / 2))) & 0xF;
                    let high = (qh[32 * h + l] >> (2 * kq)) & 3;
                    *v = i16::from(low | (high << 4)) - 32;
                }
                // as `int16`'s units
                d[2 * blk] = dd * f32::from(scales[2 * i] as i8);
                d[2 * blk + 1] = dd * f32::from(scales[2 * i + 1] as i8);
                m[blk] = 0.0;
            }
        }
        return;
    }
    if t.block().0 == QK_K {
        let five = t == QType::Q5_K;
        for (sb, b) in row.chunks_exact(bytes).enumerate() {
            let (scales, mins) = super::int16::k_scales(&b[4..16]);
            let (dd, dmin) = (half(b, 0), half(b, 2));
            let qs = &b[if five { 48 } else { 16 }..];
            for i in 0..8 {
                let blk = 8 * sb + i;
                let group = &qs[32 * (i / 2)..32 * (i / 2) + 32];
                let dst = &mut q[QK * blk..QK * (blk + 1)];
                for (l, (v, g)) in dst.iter_mut().zip(group).enumerate() {
                    let bit4 = if five { ((b[16 + l] >> i) & 1) << 4 } else { 0 };
                    *v = i16::from(((g >> (4 * (i % 2))) & 0xF) | bit4);
                }
                // as `int16`'s units (and the dequantized weight `(d·sc)·q - dmin·m`)
                d[2 * blk] = dd * f32::from(scales[i]);
                d[2 * blk + 1] = d[2 * blk];
                m[blk] = -(dmin * f32::from(mins[i]));
            }
        }
        return;
    }
    for (blk, b) in row.chunks_exact(bytes).enumerate() {
        let dst = &mut q[QK * blk..QK * (blk + 1)];
        d[2 * blk] = half(b, 0);
        d[2 * blk + 1] = d[2 * blk];
        m[blk] = 0.0;
        match t {
            QType::Q8_0 => {
                for (q, v) in dst.iter_mut().zip(&b[2..34]) {
                    *q = i16::from(*v as i8);
                }
            }
            QType::Q4_0 | QType::Q4_1 => {
                let (at, offset) = if t == QType::Q4_0 { (2, 8) } else { (4, 0) };
                let (lo, hi) = dst.split_at_mut(16);
                for ((l, h), v) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[at..at + 16]) {
                    *l = i16::from(v & 0xF) - offset;
                    *h = i16::from(v >> 4) - offset;
                }
            }
            QType::Q5_0 | QType::Q5_1 => {
                let (h, offset) = if t == QType::Q5_0 { (2, 16) } else { (4, 0) };
                let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
                for (j, v) in dst.iter_mut().enumerate() {
                    *v = i16::from(five_bits(&b[h + 4..h + 20], qh, j)) - offset;
                }
            }
            _ => unreachable!("{} is not taken by the integer panels", t.name()),
        }
        if matches!(t, QType::Q4_1 | QType::Q5_1) {
            m[blk] = half(b, 2);
        }
    }
}

impl Panel {
    /// Widens the weight rows `rows` (each of a type `takes`, or repacked from one: read in
    /// place, `k` elements; at most `PANEL`, the missing ones zero) into the panel.
    pub(super) fn pack(&mut self, rows: &[(QType, &[u8])], k: usize, fast: bool) {
        assert!(rows.len() <= PANEL && k.is_multiple_of(QK));
        let (pairs, blocks) = (k / 2, k / QK);
        // rows a cache line apart beyond k (see `prefill_rows`)
        let stride = pairs + 16;
        // zeroed only where a size changes or a row is missing (the columns past k are never
        // read): the whole buffer's memset each panel showed in the profile
        if self.staging.len() != PANEL * stride {
            self.staging.clear();
            self.staging.resize(PANEL * stride, 0.0);
        }
        self.staging[rows.len() * stride..].fill(0.0);
        self.halves = rows.iter().any(|(t, _)| *t == QType::Q6_K);
        let per_block = if self.halves { 2 } else { 1 };
        self.scales.clear();
        self.scales.resize(per_block * blocks * PANEL, 0.0);
        let mins = rows.iter().any(|(t, _)| has_min(*t));
        self.mins.clear();
        if mins {
            self.mins.resize(blocks * PANEL, 0.0);
        }
        self.row_scales.resize(2 * blocks, 0.0);
        self.row_mins.resize(blocks, 0.0);
        // SAFETY: the staging floats viewed as twice as many i16 (f32's alignment is i16's
        // twice); every bit pattern is a valid value of both.
        let staging: &mut [i16] = unsafe {
            std::slice::from_raw_parts_mut(
                self.staging.as_mut_ptr().cast::<i16>(),
                2 * self.staging.len(),
            )
        };
        for (j, (t, row)) in rows.iter().enumerate() {
            let dst = &mut staging[2 * j * stride..2 * j * stride + k];
            // Q8_0's rows stay on the portable loop (the compiler vectorizes its i8 -> i16):
            // SmolLM2 Q8_0 at 32 rows measured no faster this way (benches/RESULTS.md, round 9)
            #[cfg(target_arch = "x86_64")]
            if fast && *t != QType::Q8_0 {
                // SAFETY: `fast` is set only on a CPU with avx2, fma and f16c; the row holds
                // k = dst.len() elements of a type taken (every one `int16` takes).
                unsafe {
                    super::int16::avx2::row_codes(*t, row, dst);
                    let mins = &mut self.mins[..];
                    unit_scales_f16c(*t, row, j, self.halves, &mut self.scales, mins);
                }
                continue;
            }
            widen_row(*t, row, dst, &mut self.row_scales, &mut self.row_mins);
            // a scale per unit: each 16 elements' in a panel of halves, else each block's first
            for (u, d) in self.row_scales.iter().step_by(2 / per_block).enumerate() {
                self.scales[u * PANEL + j] = *d;
            }
            if mins {
                for (b, m) in self.row_mins.iter().enumerate() {
                    self.mins[b * PANEL + j] = *m;
                }
            }
        }
        self.codes.resize(pairs * PANEL, 0.0);
        transpose_into_panel(&self.staging, stride, pairs, &mut self.codes, fast);
    }
}

/// `widen_row`'s scales and mins of the panel's row `j` (type `t`, bytes `row`) written straight
/// to the panel's `scales` (`[units, PANEL]`, two units a block where `halves`) and `mins`
/// (`[blocks, PANEL]`, or empty: then no row has one), the f16s converted by F16C (exact, the
/// same values as `f16_to_f32`): the portable loop's per-block work showed beside the products.
///
/// # Safety
/// The CPU supports avx2, fma and f16c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unit_scales_f16c(
    t: QType,
    row: &[u8],
    j: usize,
    halves: bool,
    scales: &mut [f32],
    mins: &mut [f32],
) {
    let per_block = if halves { 2 } else { 1 };
    let mut put = |blk: usize, d: [f32; 2], m: f32| {
        scales[per_block * blk * PANEL + j] = d[0];
        if halves {
            scales[(2 * blk + 1) * PANEL + j] = d[1];
        }
        if !mins.is_empty() {
            mins[blk * PANEL + j] = m;
        }
    };
    let bytes = t.block().1;
    if t == QType::Q6_K {
        for (sb, b) in row.chunks_exact(bytes).enumerate() {
            let dd = half_f16c(b, 208);
            for i in 0..8 {
                let sc = |u: usize| dd * f32::from(b[192 + 2 * i + u] as i8);
                put(8 * sb + i, [sc(0), sc(1)], 0.0);
            }
        }
    } else if t.block().0 == QK_K {
        for (sb, b) in row.chunks_exact(bytes).enumerate() {
            let (sc, mn) = super::int16::k_scales(&b[4..16]);
            let (dd, dmin) = (half_f16c(b, 0), half_f16c(b, 2));
            for i in 0..8 {
                let d = dd * f32::from(sc[i]);
                put(8 * sb + i, [d, d], -(dmin * f32::from(mn[i])));
            }
        }
    } else if repack::repacked(t) {
        // each group's n scales first, then (Q4_1R) its n mins (`repack`)
        let min = repack::read_as(t) == QType::Q4_1;
        for (g, src) in row.chunks(repack::GROUP * bytes).enumerate() {
            let n = src.len() / bytes;
            for j in 0..n {
                let d = half_f16c(src, 2 * j);
                let m = if min {
                    half_f16c(src, 2 * n + 2 * j)
                } else {
                    0.0
                };
                put(repack::GROUP * g + j, [d, d], m);
            }
        }
    } else {
        let min = matches!(t, QType::Q4_1 | QType::Q5_1);
        for (blk, b) in row.chunks_exact(bytes).enumerate() {
            let d = half_f16c(b, 0);
            put(blk, [d, d], if min { half_f16c(b, 2) } else { 0.0 });
        }
    }
}

/// The f16 at byte `at` of `b` as f32 by F16C (inlined into a caller that enables it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn half_f16c(b: &[u8], at: usize) -> f32 {
    use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
    let h = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

/// Whether weights of type `t` have a min (`int16`'s).
fn has_min(t: QType) -> bool {
    matches!(
        repack::read_as(t),
        QType::Q4_1 | QType::Q5_1 | QType::Q4_K | QType::Q5_K
    )
}

impl Panel {
    /// `acc[r][j] = Σ_k w[j][k] · x[r][k]` for the panel's 16 rows `j` and every row `r` of
    /// `x` (`acc` holds x's rows).
    pub(super) fn product(&self, x: &QuantizedRows, acc: &mut [[f32; PANEL]], fast: bool) {
        #[cfg(target_arch = "x86_64")]
        if fast && super::vnni() {
            // SAFETY: `vnni()` holds only where the process runs at AVX-512 with VNNI.
            unsafe { product_vnni(self, x, acc) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: `fast` is set only on a CPU with avx2, fma and f16c.
            unsafe { product_avx2(self, x, acc) };
            return;
        }
        let _ = fast;
        product_portable(self, x, acc);
    }
}

/// `Panel::product` one element at a time, in the AVX2 path's order.
fn product_portable(panel: &Panel, x: &QuantizedRows, acc: &mut [[f32; PANEL]]) {
    let codes: Vec<[i16; 2]> = panel
        .codes
        .iter()
        .map(|v| {
            let b = v.to_bits();
            [b as u16 as i16, (b >> 16) as u16 as i16]
        })
        .collect();
    let units = if panel.halves { 2 } else { 1 };
    let pairs = QK / 2 / units;
    for (r, sums) in acc.iter_mut().enumerate() {
        let row = x.row(r);
        *sums = [0.0; PANEL];
        for (b, dx) in row.d.iter().enumerate() {
            for (j, s) in sums.iter_mut().enumerate() {
                for h in 0..units {
                    let mut int = 0i32;
                    for p in h * pairs..(h + 1) * pairs {
                        let w = codes[(b * QK / 2 + p) * PANEL + j];
                        let q = &row.q[b * QK + 2 * p..];
                        int +=
                            i32::from(w[0]) * i32::from(q[0]) + i32::from(w[1]) * i32::from(q[1]);
                    }
                    let d = panel.scales[(b * units + h) * PANEL + j];
                    *s = (int as f32).mul_add(d * dx, *s);
                }
                if !panel.mins.is_empty() {
                    *s = panel.mins[b * PANEL + j].mul_add(row.s[b], *s);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn product_avx2(panel: &Panel, x: &QuantizedRows, acc: &mut [[f32; PANEL]]) {
    let m = acc.len();
    let mut r = 0;
    while r < m {
        let rows = (m - r).min(TILE);
        let out = &mut acc[r..r + rows];
        match (rows, panel.halves) {
            (1, false) => tile_avx2::<1, 1>(panel, x, r, out),
            (2, false) => tile_avx2::<2, 1>(panel, x, r, out),
            (_, false) => tile_avx2::<3, 1>(panel, x, r, out),
            (1, true) => tile_avx2::<1, 2>(panel, x, r, out),
            (2, true) => tile_avx2::<2, 2>(panel, x, r, out),
            (_, true) => tile_avx2::<3, 2>(panel, x, r, out),
        }
        r += rows;
    }
}

/// Rows `first..first + R` of x over the whole panel, the sums in registers; `U` units a
/// block (1, or 2 halves of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile_avx2<const R: usize, const U: usize>(
    panel: &Panel,
    x: &QuantizedRows,
    first: usize,
    out: &mut [[f32; PANEL]],
) {
    use std::arch::x86_64::*;
    let rows: [_; R] = std::array::from_fn(|r| x.row(first + r));
    let blocks = rows[0].d.len();
    debug_assert!(panel.codes.len() == blocks * QK / 2 * PANEL);
    let w = panel.codes.as_ptr().cast::<__m256i>();
    let mut f = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..blocks {
        for h in 0..U {
            let mut s = [[_mm256_setzero_si256(); 2]; R];
            for p in h * QK / 2 / U..(h + 1) * QK / 2 / U {
                // pair p of block b: 16 rows' two codes, two vectors of 8 (inside codes)
                let w0 = _mm256_loadu_si256(w.add((b * QK / 2 + p) * 2));
                let w1 = _mm256_loadu_si256(w.add((b * QK / 2 + p) * 2 + 1));
                for (sr, row) in s.iter_mut().zip(&rows) {
                    // elements b * 32 + 2p and + 1 of the row: inside its k codes
                    let pair = row
                        .q
                        .as_ptr()
                        .add(b * QK + 2 * p)
                        .cast::<i32>()
                        .read_unaligned();
                    let xv = _mm256_set1_epi32(pair);
                    sr[0] = _mm256_add_epi32(sr[0], _mm256_madd_epi16(w0, xv));
                    sr[1] = _mm256_add_epi32(sr[1], _mm256_madd_epi16(w1, xv));
                }
            }
            let scales = panel.scales.as_ptr().add((b * U + h) * PANEL);
            let (d0, d1) = (_mm256_loadu_ps(scales), _mm256_loadu_ps(scales.add(8)));
            for ((fr, sr), row) in f.iter_mut().zip(&s).zip(&rows) {
                let dx = _mm256_set1_ps(row.d[b]);
                fr[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sr[0]), _mm256_mul_ps(d0, dx), fr[0]);
                fr[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sr[1]), _mm256_mul_ps(d1, dx), fr[1]);
            }
        }
        if !panel.mins.is_empty() {
            let mins = panel.mins.as_ptr().add(b * PANEL);
            let (m0, m1) = (_mm256_loadu_ps(mins), _mm256_loadu_ps(mins.add(8)));
            for (fr, row) in f.iter_mut().zip(&rows) {
                let sx = _mm256_set1_ps(row.s[b]);
                fr[0] = _mm256_fmadd_ps(m0, sx, fr[0]);
                fr[1] = _mm256_fmadd_ps(m1, sx, fr[1]);
            }
        }
    }
    for (dst, fr) in out.iter_mut().zip(&f) {
        _mm256_storeu_ps(dst.as_mut_ptr(), fr[0]);
        _mm256_storeu_ps(dst.as_mut_ptr().add(8), fr[1]);
    }
}

/// `product_avx2` at AVX-512 with VNNI: a pair step of the panel's 16 rows is one 512-bit
/// register, and one `vpdpwssd` (the two products and the add of `madd` + `add`, exact: no
/// saturation) takes it times x's pair for a row of x. Each lane sums and scales as the AVX2
/// tile's does, so the results are the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn product_vnni(panel: &Panel, x: &QuantizedRows, acc: &mut [[f32; PANEL]]) {
    let m = acc.len();
    let mut r = 0;
    while r < m {
        let rows = (m - r).min(TILE_VNNI);
        let out = &mut acc[r..r + rows];
        if panel.halves {
            tiles_vnni::<2>(panel, x, r, out);
        } else {
            tiles_vnni::<1>(panel, x, r, out);
        }
        r += rows;
    }
}

/// `tile_vnni` for the rows of `out` (at most `TILE_VNNI`), x's from row `first`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tiles_vnni<const U: usize>(
    panel: &Panel,
    x: &QuantizedRows,
    first: usize,
    out: &mut [[f32; PANEL]],
) {
    match out.len() {
        1 => tile_vnni::<1, U>(panel, x, first, out),
        2 => tile_vnni::<2, U>(panel, x, first, out),
        3 => tile_vnni::<3, U>(panel, x, first, out),
        4 => tile_vnni::<4, U>(panel, x, first, out),
        5 => tile_vnni::<5, U>(panel, x, first, out),
        6 => tile_vnni::<6, U>(panel, x, first, out),
        7 => tile_vnni::<7, U>(panel, x, first, out),
        _ => tile_vnni::<8, U>(panel, x, first, out),
    }
}

/// Rows of x per AVX-512 tile: an i32 and an f32 accumulator a row within the 32 registers.
#[cfg(target_arch = "x86_64")]
const TILE_VNNI: usize = 8;

/// Rows `first..first + R` of x over the whole panel, the sums in 512-bit registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tile_vnni<const R: usize, const U: usize>(
    panel: &Panel,
    x: &QuantizedRows,
    first: usize,
    out: &mut [[f32; PANEL]],
) {
    use std::arch::x86_64::*;
    let rows: [_; R] = std::array::from_fn(|r| x.row(first + r));
    let blocks = rows[0].d.len();
    debug_assert!(panel.codes.len() == blocks * QK / 2 * PANEL);
    let w = panel.codes.as_ptr().cast::<__m512i>();
    let mut f = [_mm512_setzero_ps(); R];
    for b in 0..blocks {
        for h in 0..U {
            let mut s = [_mm512_setzero_si512(); R];
            for p in h * QK / 2 / U..(h + 1) * QK / 2 / U {
                // pair p of block b: 16 rows' two codes, one 512-bit vector (inside codes)
                let wv = _mm512_loadu_si512(w.add(b * QK / 2 + p).cast());
                for (sr, row) in s.iter_mut().zip(&rows) {
                    // elements b * 32 + 2p and + 1 of the row: inside its k codes
                    let pair = row
                        .q
                        .as_ptr()
                        .add(b * QK + 2 * p)
                        .cast::<i32>()
                        .read_unaligned();
                    *sr = _mm512_dpwssd_epi32(*sr, wv, _mm512_set1_epi32(pair));
                }
            }
            let d = _mm512_loadu_ps(panel.scales.as_ptr().add((b * U + h) * PANEL));
            for ((fr, sr), row) in f.iter_mut().zip(&s).zip(&rows) {
                let dx = _mm512_set1_ps(row.d[b]);
                *fr = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*sr), _mm512_mul_ps(d, dx), *fr);
            }
        }
        if !panel.mins.is_empty() {
            let mins = _mm512_loadu_ps(panel.mins.as_ptr().add(b * PANEL));
            for (fr, row) in f.iter_mut().zip(&rows) {
                *fr = _mm512_fmadd_ps(mins, _mm512_set1_ps(row.s[b]), *fr);
            }
        }
    }
    for (dst, fr) in out.iter_mut().zip(&f) {
        _mm512_storeu_ps(dst.as_mut_ptr(), *fr);
    }
}
