//! The decode path's 16-bit-activation products (`int16`) at AVX-512 with VNNI: the same units,
//! the same exact integer sums and the same f32 steps, so the results equal `int16::row_dot` and
//! `int16::row_dots_avx2` bit for bit; only the integer sums are taken differently.
//!
//! `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds each 4 products to an
//! i32 lane (one instruction where AVX2 widens to 16 bits and takes two `vpmaddwd`). x's 16-bit
//! codes are split once per call into a signed high byte and an unsigned low byte (`Planes`:
//! q = 256·hi + lo, hi in -128..=127, lo in 0..=255), so a unit's sum is
//! `256·Σ w·hi + Σ w·lo`, two `vpdpbusd` and a shift per 64 weights:
//! - the types with unsigned codes (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, codes 0..=63)
//!   are the unsigned operand against hi and the signed one against lo; their offsets (Q4_0's
//!   8, Q5_0's 16, Q6_K's 32) come off as `c·Σ q_x` from x's integer code sums per unit;
//! - Q8_0's signed codes are the signed operand against lo and, shifted by 128 to unsigned,
//!   against hi: `Σ (w + 128)·hi = Σ w·hi + 128·Σ hi`, the second term from x's sums of hi.
//!
//! Every partial sum stays below 2^31 (per lane: 4 · 255 · 128 · 256 + 4 · 255 · 128) and the
//! unit sums are those `int16` bounds (< 2^28), so the integer sums are exact; each unit's 8
//! (or 4: Q6_K's units of 16) lanes are reduced in registers to the AVX2 path's vector of 8
//! unit sums, which then takes AVX2's very f32 steps (`int16::avx2`'s helpers).
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::dot_avx2::half;
use super::formats::QType;
use super::int16::avx2::{add, bytes32, f16s, k_factors, load8, Lanes};
use super::int16::{QuantizedRows, Row};

/// Elements per block of x.
const QK: usize = 32;
/// Zero bytes after the last row's planes: a last group with an odd count of blocks reads 32
/// bytes of x past its last block (times zero weights).
const PAD: usize = 64;

/// x's 16-bit codes (`int16::QuantizedRows`) as the byte planes and integer sums the VNNI
/// products take.
pub struct Planes {
    /// `[m, k]` then `PAD` zeros: each code's high byte (`q >> 8`).
    hi: Vec<i8>,
    /// `[m, k]` then `PAD` zeros: each code's low byte (`q & 255`).
    lo: Vec<u8>,
    /// `[m, k / 16]`: the codes' sums per 16 elements.
    sum16: Vec<i32>,
    /// `[m, k / 32]`: the codes' sums per 32 elements.
    sum32: Vec<i32>,
    /// `[m, k / 32]`: 32768 times the high bytes' sums per 32 elements (Q8_0's offset).
    hsum: Vec<i32>,
    /// `[m, kp]` (`kp`: k rounded up to 128), or empty: `hi` in repacked Q4_0's order
    /// (`permuted`).
    phi: Vec<i8>,
    /// `[m, kp]`, or empty: `lo` in repacked Q4_0's order.
    plo: Vec<u8>,
    /// `[m, k]` then `PAD` zeros, or empty: `hi` in repacked Q8_0's order (`transposed`).
    thi: Vec<i8>,
    /// `[m, k]` then `PAD` zeros, or empty: `lo` in repacked Q8_0's order.
    tlo: Vec<u8>,
    /// `[m, k]` then `PAD` zeros, or empty: `hi` in repacked Q5_0's order of full groups.
    nhi: Vec<i8>,
    /// `[m, k]` then `PAD` zeros, or empty: `lo` in that order.
    nlo: Vec<u8>,
    k: usize,
}

/// One row of `Planes`.
#[derive(Clone, Copy)]
pub struct PlaneRow<'a> {
    /// The row's first high byte; `k + PAD` readable from it.
    pub(super) hi: *const i8,
    /// The row's first low byte; `k + PAD` readable from it.
    pub(super) lo: *const u8,
    pub(super) sum16: &'a [i32],
    pub(super) sum32: &'a [i32],
    pub(super) hsum: &'a [i32],
    /// The row's first high byte in repacked Q4_0's order (`Planes::permuted`; `kp` readable
    /// from it), or null.
    pub(super) phi: *const i8,
    /// The row's first low byte in that order, or null.
    pub(super) plo: *const u8,
    /// The row's first high byte in repacked Q8_0's order (`Planes::transpose`; `k + PAD`
    /// readable from it), or null.
    pub(super) thi: *const i8,
    /// The row's first low byte in that order, or null.
    pub(super) tlo: *const u8,
    /// The row's first high byte in repacked Q5_0's order of full groups (`Q5_0R_WORDS`; `k +
    /// PAD` readable from it), or null.
    pub(super) nhi: *const i8,
    /// The row's first low byte in that order, or null.
    pub(super) nlo: *const u8,
}

impl Planes {
    /// The `m` rows of `x` (`k` elements each, a multiple of 32) split, and for rows of the
    /// `types` their planes in the orders they read as well: repacked Q4_0's (`QType::Q4_0R`,
    /// `QType::Q4_1R`, `QType::Q5_0R`'s short groups), Q8_0's (`QType::Q8_0R`), Q5_0's
    /// (`QType::Q5_0R`'s full groups).
    pub fn new(x: &QuantizedRows, m: usize, k: usize, types: &[QType]) -> Self {
        debug_assert!(k.is_multiple_of(QK));
        let mut planes = Self {
            hi: Vec::with_capacity(m * k + PAD),
            lo: Vec::with_capacity(m * k + PAD),
            sum16: Vec::with_capacity(m * k / 16),
            sum32: Vec::with_capacity(m * k / QK),
            hsum: Vec::with_capacity(m * k / QK),
            phi: Vec::new(),
            plo: Vec::new(),
            thi: Vec::new(),
            tlo: Vec::new(),
            nhi: Vec::new(),
            nlo: Vec::new(),
            k,
        };

        for i in 0..m {
            let q = x.row(i).q;
            planes.hi.extend(q.iter().map(|v| (v >> 8) as i8));
            planes.lo.extend(q.iter().map(|v| *v as u8));
            planes.sum16.extend(
                q.chunks_exact(16)
                    .map(|c| c.iter().map(|v| i32::from(*v)).sum::<i32>()),
            );
            let sum16 = &planes.sum16[i * k / 16..];
            planes
                .sum32
                .extend(sum16.chunks_exact(2).take(k / QK).map(|p| p[0] + p[1]));
            planes.hsum.extend(
                q.chunks_exact(QK)
                    .map(|c| 32768 * c.iter().map(|v| i32::from(v >> 8)).sum::<i32>()),
            );
        }
        if types.iter().any(|t| permutes(*t)) {
            planes.permute(m);
        }
        if types.contains(&QType::Q8_0R) {
            planes.thi = reorder_groups(&planes.hi, k, &Q8_0R_WORDS);
            planes.tlo = reorder_groups(&planes.lo, k, &Q8_0R_WORDS);
        }
        if types.contains(&QType::Q5_0R) {
            planes.nhi = reorder_groups(&planes.hi, k, &Q5_0R_WORDS);
            planes.nlo = reorder_groups(&planes.lo, k, &Q5_0R_WORDS);
        }
        planes.hi.resize(m * k + PAD, 0);
        planes.lo.resize(m * k + PAD, 0);
        planes
    }

    /// `hi` and `lo` in repacked Q4_0's order (`vnni4`'s Q4_0R products): per 4 blocks
    /// (128 elements, a 64-byte load of their nibbles), the low halves (elements 0-15) of the
    /// 4 blocks, then their high halves, so the low nibbles of the load meet the first 64
    /// bytes and the high nibbles the next 64; zeros past the row's last block.
    fn permute(&mut self, m: usize) {
        let (k, kp) = (self.k, self.k.next_multiple_of(4 * QK));
        self.phi.resize(m * kp, 0);
        self.plo.resize(m * kp, 0);
        for i in 0..m {
            for e in 0..k {
                let (blk, j) = (e / QK, e % QK);
                let at = 4 * QK * (blk / 4) + 16 * (blk % 4) + j % 16 + 64 * (j / 16);
                self.phi[i * kp + at] = self.hi[i * k + e];
                self.plo[i * kp + at] = self.lo[i * k + e];
            }
        }
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> PlaneRow<'_> {
        let (k, kb, kp) = (self.k, self.k / QK, self.k.next_multiple_of(4 * QK));
        let permuted = !self.phi.is_empty();
        PlaneRow {
            hi: self.hi[i * k..].as_ptr(),
            lo: self.lo[i * k..].as_ptr(),
            sum16: &self.sum16[2 * i * kb..2 * (i + 1) * kb],
            sum32: &self.sum32[i * kb..(i + 1) * kb],
            hsum: &self.hsum[i * kb..(i + 1) * kb],
            phi: if permuted {
                self.phi[i * kp..].as_ptr()
            } else {
                std::ptr::null()
            },
            plo: if permuted {
                self.plo[i * kp..].as_ptr()
            } else {
                std::ptr::null()
            },
            thi: if self.thi.is_empty() {
                std::ptr::null()
            } else {
                self.thi[i * k..].as_ptr()
            },
            tlo: if self.tlo.is_empty() {
                std::ptr::null()
            } else {
                self.tlo[i * k..].as_ptr()
            },
            nhi: if self.nhi.is_empty() {
                std::ptr::null()
            } else {
                self.nhi[i * k..].as_ptr()
            },
            nlo: if self.nlo.is_empty() {
                std::ptr::null()
            } else {
                self.nlo[i * k..].as_ptr()
            },
        }
    }
}

/// Rows of `k` bytes `v` (a whole number of them) with each full group of 8 blocks' 64 4-byte
/// words in the order `words` gives (position w holds the group's word `words[w]`), a short last
/// group as it is, then `PAD` zeros.
fn reorder_groups<T: Copy + Default>(v: &[T], k: usize, words: &[usize; 64]) -> Vec<T> {
    let mut out = vec![T::default(); v.len() + PAD];
    for (row, dst) in v.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        for (g, d) in row.chunks(8 * QK).zip(dst.chunks_mut(8 * QK)) {
            if g.len() < 8 * QK {
                d.copy_from_slice(g);
                continue;
            }
            for (d, w) in d.chunks_exact_mut(4).zip(words) {
                d.copy_from_slice(&g[4 * w..4 * w + 4]);
            }
        }
    }
    out
}

/// Repacked Q8_0's order of a full group's words (`repack::transpose_words`): word 8j + b is
/// word j of block b.
const Q8_0R_WORDS: [usize; 64] = {
    let mut t = [0; 64];
    let mut w = 0;
    while w < 64 {
        t[w] = 8 * (w % 8) + w / 8;
        w += 1;
    }
    t
};

/// Repacked Q5_0's order of a full group's words (`repack::q5_0_masks_and_words`): per half c
/// of its nibbles (32 words), the words of its low nibbles' elements then of its high nibbles'
/// (h = 0, 1); word l of either is word 4h + j of block l % 8 (j = 2c + l / 8).
const Q5_0R_WORDS: [usize; 64] = {
    let mut t = [0; 64];
    let mut w = 0;
    while w < 64 {
        let (c, h, l) = (w / 32, w / 16 % 2, w % 16);
        t[w] = 8 * (l % 8) + 4 * h + 2 * c + l / 8;
        w += 1;
    }
    t
};

/// Per row of x, the 16 i32 lanes of 64 codes: `wa` the unsigned operand against the high
/// bytes, `wb` the signed one against the low bytes, at elements `e..e + 64` of the row.
#[inline(always)]
unsafe fn dots<const R: usize>(
    wa: __m512i,
    wb: __m512i,
    p: &[PlaneRow<'_>; R],
    e: usize,
) -> [__m512i; R] {
    let mut out = [_mm512_setzero_si512(); R];
    for (o, p) in out.iter_mut().zip(p) {
        // elements e..e + 64: inside the row's k + PAD bytes (e + 32 < k)
        let hi = _mm512_loadu_si512(p.hi.add(e).cast());
        let lo = _mm512_loadu_si512(p.lo.add(e).cast());
        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, hi);
        *o = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(s), lo, wb);
    }
    out
}

/// Each 128-bit lane of `a` (units 0-3) and `b` (units 4-7) summed: unit u's sum in lane u.
#[inline(always)]
pub(super) unsafe fn reduce_quads(a: __m512i, b: __m512i) -> __m256i {
    // per 128-bit lane: a's two pair sums, then b's
    let t = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    // lanes 4L and 4L + 2: a's and b's sums of 128-bit lane L
    let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0xB1>(t));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, t))
}

/// Four vectors of two units of 32 (low and high 256 bits; units 0-7 in order): each unit's 8
/// lanes summed, unit u's sum in lane u.
#[inline(always)]
pub(super) unsafe fn reduce_pairs(z: [__m512i; 4]) -> __m256i {
    reduce_quads(quads(z[0], z[1]), quads(z[2], z[3]))
}

/// 128-bit lanes 0 + 1 and 2 + 3 of `a`, then of `b`: one unit's 4 partial sums a 128-bit lane.
#[inline(always)]
pub(super) unsafe fn quads(a: __m512i, b: __m512i) -> __m512i {
    _mm512_add_epi32(
        _mm512_shuffle_i64x2::<0x88>(a, b),
        _mm512_shuffle_i64x2::<0xDD>(a, b),
    )
}

/// Elements `at..at + n` (`n` <= 8) of `v` as i32 lanes, 0 past n.
#[inline(always)]
pub(super) unsafe fn load_i32(v: &[i32], at: usize, n: usize) -> __m256i {
    _mm256_maskz_loadu_epi32(((1u32 << n) - 1) as u8, v.as_ptr().add(at).cast())
}

/// The 16 bytes at `at`, twice.
#[inline(always)]
unsafe fn twice(at: *const u8) -> __m256i {
    _mm256_broadcastsi128_si256(_mm_loadu_si128(at.cast()))
}

/// The u32 at `at` (a block's qh).
#[inline(always)]
unsafe fn qh_bits(at: *const u8) -> u64 {
    u64::from(at.cast::<u32>().read_unaligned())
}

/// Blocks at `b` and (`two`) `b + bytes32(T)` of the 32-element block type of ggml code `T` as
/// 64 codes in element order (the second block's 0 when not `two`): Q8_0's signed bytes, the
/// others' unsigned codes without their offset.
#[inline(always)]
pub(super) unsafe fn codes64<const T: u32>(b: *const u8, two: bool) -> __m512i {
    let bytes = bytes32(T);
    if T == 8 {
        let second = if two {
            _mm256_loadu_si256(b.add(bytes + 2).cast())
        } else {
            _mm256_setzero_si256()
        };
        let first = _mm256_loadu_si256(b.add(2).cast());
        return _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second);
    }
    // the 16 bytes of nibbles twice a block, the copies shifted by 0 and 4: low nibbles
    // (elements 0-15) then high (16-31)
    let qs = match T {
        2 => 2,
        3 => 4,
        6 => 6,
        _ => 8,
    };
    let second = if two {
        twice(b.add(bytes + qs))
    } else {
        _mm256_setzero_si256()
    };
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(twice(b.add(qs))), second);
    let shift = 0x0004_0004_0004_0004;
    let both = _mm512_srlv_epi16(
        both,
        _mm512_setr_epi64(0, 0, shift, shift, 0, 0, shift, shift),
    );
    let mut q = _mm512_and_si512(both, _mm512_set1_epi8(0xF));
    if T == 6 || T == 7 {
        // bit j of a block's qh is element j's bit 4
        let h = if T == 6 { 2 } else { 4 };
        let bits = qh_bits(b.add(h))
            | if two {
                qh_bits(b.add(bytes + h)) << 32
            } else {
                0
            };
        q = _mm512_mask_add_epi8(q, bits, q, _mm512_set1_epi8(16));
    }
    q
}

/// `int16::avx2::group32` on VNNI: blocks `blk0..blk0 + n` (`n` <= 8) of a row of the
/// 32-element block type of ggml code `T` times the same blocks of each row of x.
#[inline(always)]
unsafe fn group32<const R: usize, const T: u32>(
    row: &[u8],
    blk0: usize,
    n: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    lanes: &mut Lanes<R>,
) {
    let bytes = bytes32(T);
    // blocks blk0..blk0 + n: inside the row
    let b = row.as_ptr().add(blk0 * bytes);
    let mut z = [[_mm512_setzero_si512(); 4]; R];
    for j in 0..4 {
        let first = 2 * j;
        if first >= n {
            break;
        }
        let two = first + 1 < n;
        let w = codes64::<T>(b.add(first * bytes), two);
        let wa = if T == 8 {
            // shifted to unsigned; a missing second block stays 0
            let valid = if two { u16::MAX } else { 0x00FF };
            _mm512_maskz_xor_epi32(valid, w, _mm512_set1_epi8(-128))
        } else {
            w
        };
        let d = dots(wa, w, p, QK * (blk0 + first));
        for (z, d) in z.iter_mut().zip(d) {
            z[j] = d;
        }
    }
    let mut s = [_mm256_setzero_si256(); R];
    for ((s, z), p) in s.iter_mut().zip(z).zip(p) {
        let sums = reduce_pairs(z);
        *s = match T {
            8 => _mm256_sub_epi32(sums, load_i32(p.hsum, blk0, n)),
            2 => _mm256_sub_epi32(sums, _mm256_slli_epi32::<3>(load_i32(p.sum32, blk0, n))),
            6 => _mm256_sub_epi32(sums, _mm256_slli_epi32::<4>(load_i32(p.sum32, blk0, n))),
            _ => sums,
        };
    }
    // from here as `int16::avx2::group32`
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
    p: &[PlaneRow<'_>; R],
    lanes: &mut Lanes<R>,
) {
    let blocks = k / QK;
    let mut blk = 0;
    while blk + 8 <= blocks {
        group32::<R, T>(row, blk, 8, x, p, lanes);
        blk += 8;
    }
    if blk < blocks {
        group32::<R, T>(row, blk, blocks - blk, x, p, lanes);
    }
}

/// A Q4_K or (`FIVE`) Q5_K row, a super-block (8 sub-blocks: 8 units) at a time.
#[inline(always)]
unsafe fn k_rows<const R: usize, const FIVE: bool>(
    row: &[u8],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    lanes: &mut Lanes<R>,
) {
    let bytes = if FIVE { 176 } else { 144 };
    let nibble = _mm512_set1_epi8(0xF);
    for sb in 0..k / 256 {
        // super-block sb: row[sb * bytes..(sb + 1) * bytes], inside the row
        let b = row.as_ptr().add(sb * bytes);
        let qs = b.add(if FIVE { 48 } else { 16 });
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16).cast()));
        let mut z = [[_mm512_setzero_si512(); 4]; R];
        for g in 0..4 {
            // sub-blocks 2g (low nibbles) and 2g + 1 (high nibbles) of 32 bytes
            let v = _mm256_loadu_si256(qs.add(32 * g).cast());
            let both =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
            let mut w = _mm512_and_si512(both, nibble);
            if FIVE {
                // bit i of each qh byte is sub-block i's bit 4
                let sel = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi8((1u8 << (2 * g)) as i8),
                    _mm256_set1_epi8((1u8 << (2 * g + 1)) as i8),
                );
                let set = _mm512_test_epi8_mask(qh, sel);
                w = _mm512_mask_add_epi8(w, set, w, _mm512_set1_epi8(16));
            }
            let d = dots(w, w, p, 256 * sb + 64 * g);
            for (z, d) in z.iter_mut().zip(d) {
                z[g] = d;
            }
        }
        let mut s = [_mm256_setzero_si256(); R];
        for (s, z) in s.iter_mut().zip(z) {
            *s = reduce_pairs(z);
        }
        // from here as `int16::avx2::k_rows`
        let blk0 = 8 * sb;
        let (dl, ml) = k_factors(b);
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

/// About how far ahead of a weight row's current group the row kernels prefetch (`prefetch_ahead`).
const PREFETCH_BYTES: usize = 16 << 10;

/// The distance `prefetch_rows` takes for rows of `row_bytes` read `rows` a pass: the same
/// group `n` rows on, `n` the multiple of `rows` (at least two passes) reaching `PREFETCH_BYTES`.
/// Taken by the repacked Q4_0 / Q5_0 rows (`vnni4`), whose 8 rows ahead fell short on short
/// rows: SmolLM2's 576-element Q4_0 rows 2.6 KiB ahead decoded 1.17x slower than 16 KiB, the
/// 0.73 B Llama's 2,048-element rows 1.05x (one thread; 8, 16 and 32 KiB tried: benches/
/// RESULTS.md, round 13). Q8_0R, Q4_1R and the K-quants keep their tuned 16 rows (16 KiB was
/// no faster on either model's Q8_0).
#[inline(always)]
pub(super) fn prefetch_ahead(row_bytes: usize, rows: usize) -> usize {
    let n = PREFETCH_BYTES
        .div_ceil(row_bytes.max(1))
        .next_multiple_of(rows);
    n.max(2 * rows) * row_bytes
}

/// The `bytes` bytes `ahead` bytes past each of the weight rows' current positions `at`
/// prefetched into L1: a hint, no fault past the weight's end (from memory the hardware
/// prefetcher alone does not keep several rows streaming: round 9, H1). Non-temporal: a row's
/// bytes are used by this pass only (SmolLM2 Q4_0 decode 1.03-1.08x, the 0.73 B Llama's
/// Q4_K_M 1.02-1.03x, 8-stream serving unchanged).
#[inline(always)]
pub(super) unsafe fn prefetch_rows<const W: usize>(at: [*const u8; W], ahead: usize, bytes: usize) {
    for b in at {
        let b = b.wrapping_add(ahead);
        let mut line = 0;
        while line < bytes {
            _mm_prefetch::<_MM_HINT_NTA>(b.wrapping_add(line).cast());
            line += 64;
        }
        _mm_prefetch::<_MM_HINT_NTA>(b.wrapping_add(bytes - 1).cast());
    }
}

/// A Q6_K half super-block's 128 codes (0..=63) from its 64 bytes of low bits at `ql` and 32
/// of high bits at `qh`, as two vectors in the order of x's planes: quarters 0-1 (`w01`) and
/// 2-3 (`w23`).
///
/// # Safety
/// AVX-512 BW; `ql` and `qh` readable for 64 and 32 bytes.
#[inline(always)]
pub(super) unsafe fn q6_k_half(ql: *const u8, qh: *const u8) -> (__m512i, __m512i) {
    let (nibble, bits45) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x30));
    // quarter q's 2 high bits are bits 2q of qh: to bits 4-5 by << 4, << 2 (quarters 0, 1)
    // and >> 0, >> 2 (quarters 2, 3), per 16-bit lane, then masked per byte
    let (by2, by4) = (0x0002_0002_0002_0002, 0x0004_0004_0004_0004);
    let left01 = _mm512_setr_epi64(by4, by4, by4, by4, by2, by2, by2, by2);
    let right23 = _mm512_setr_epi64(0, 0, 0, 0, by2, by2, by2, by2);
    let low = _mm512_loadu_si512(ql.cast());
    let high = _mm512_broadcast_i64x4(_mm256_loadu_si256(qh.cast()));
    let w01 = _mm512_or_si512(
        _mm512_and_si512(low, nibble),
        _mm512_and_si512(_mm512_sllv_epi16(high, left01), bits45),
    );
    let w23 = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi16::<4>(low), nibble),
        _mm512_and_si512(_mm512_srlv_epi16(high, right23), bits45),
    );
    (w01, w23)
}

/// A Q6_K row: per super-block and half h (4 sub-blocks of 32: 8 units of 16), two vectors
/// of 64 codes (quarters 0-1, 2-3) in 0..=63, the offset 32 off with x's sums per 16.
#[inline(always)]
unsafe fn q6_k_rows<const R: usize>(
    row: &[u8],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    lanes: &mut Lanes<R>,
) {
    let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for sb in 0..k / 256 {
        // super-block sb: row[sb * 210..(sb + 1) * 210], inside the row
        let b = row.as_ptr().add(sb * 210);
        let (ql, qh, scales) = (b, b.add(128), b.add(192));
        let d = _mm256_set1_ps(half(b.add(208)));
        for h in 0..2 {
            let (w01, w23) = q6_k_half(ql.add(64 * h), qh.add(32 * h));
            let e = 256 * sb + 128 * h;
            let z01 = dots(w01, w01, p, e);
            let z23 = dots(w23, w23, p, e + 64);
            let blk0 = 8 * sb + 4 * h;
            let mut s = [_mm256_setzero_si256(); R];
            for (r, (s, p)) in s.iter_mut().zip(p).enumerate() {
                // unit u (16 elements) is x's run 2 blk0 + u of 16
                let sums = _mm256_loadu_si256(p.sum16.as_ptr().add(2 * blk0).cast());
                *s = _mm256_sub_epi32(reduce_quads(z01[r], z23[r]), _mm256_slli_epi32::<5>(sums));
            }
            // from here as `int16::avx2::q6_k_rows`
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

/// Whether the decode products take `t`'s rows here rather than on the AVX2 units (the same
/// bits either way): every type but Q8_0 as stored, whose rows ran slower at VNNI end to end
/// (SmolLM2-135M Q8_0, k = 576 and 1536, one thread: 0.76x the AVX2 units' decode tok/s; the
/// 0.73 B model, k = 2048: 1.04x; benches/RESULTS.md, "ISA levels on AMD Zen 5", the lead's
/// check). Repacked Q8_0 rows (`QType::Q8_0R`, `super::q8_0r`) are taken here.
pub fn decodes(t: QType) -> bool {
    t != QType::Q8_0
}

/// Whether rows of `t` are read against x's planes in repacked Q4_0's order (`Planes::new(..,
/// types)`): Q4_0R and Q5_0R (`super::vnni4`; Q5_0R's full groups in its own order as well),
/// Q4_1R (`super::q4_1r`); Q8_0R reads them in its own order.
pub fn permutes(t: QType) -> bool {
    matches!(t, QType::Q4_0R | QType::Q5_0R | QType::Q4_1R)
}

/// Whether these planes take rows of `t`: the plain types in the natural order, the repacked
/// ones only where the planes were made in their order.
pub fn reads(p: &PlaneRow<'_>, t: QType) -> bool {
    decodes(t)
        && (!permutes(t) || !p.phi.is_null())
        && (t != QType::Q8_0R || !p.thi.is_null())
        && (t != QType::Q5_0R || !p.nhi.is_null())
}

/// `int16::row_dot` for each of the `R` rows of x (`x` its codes, `p` their planes), the
/// weight row decoded once; the same bits.
///
/// # Safety
/// The process runs at AVX-512 with VNNI (`super::vnni()`); `int16::takes(t)`; `row` holds `k`
/// elements of `t` and each row of x `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn row_dots_vnni<const R: usize>(
    t: QType,
    row: &[u8],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
) -> [f32; R] {
    let mut lanes = Lanes {
        acc: [_mm256_setzero_ps(); R],
        mins: [_mm256_setzero_ps(); R],
    };
    match t {
        QType::Q8_0 => rows32::<R, 8>(row, k, x, p, &mut lanes),
        QType::Q4_0 => rows32::<R, 2>(row, k, x, p, &mut lanes),
        QType::Q4_1 => rows32::<R, 3>(row, k, x, p, &mut lanes),
        QType::Q5_0 => rows32::<R, 6>(row, k, x, p, &mut lanes),
        QType::Q5_1 => rows32::<R, 7>(row, k, x, p, &mut lanes),
        QType::Q4_K => k_rows::<R, false>(row, k, x, p, &mut lanes),
        QType::Q5_K => k_rows::<R, true>(row, k, x, p, &mut lanes),
        QType::Q6_K => q6_k_rows::<R>(row, k, x, p, &mut lanes),
        QType::Q4_0R => {
            let mut acc = [lanes.acc];
            super::vnni4::q4_0r_rows::<1, R>([row.as_ptr()], k, x, p, &mut acc);
            lanes.acc = acc[0];
        }
        QType::Q5_0R => {
            let mut acc = [lanes.acc];
            super::vnni4::q5_0r_rows::<1, R>([row.as_ptr()], k, x, p, &mut acc);
            lanes.acc = acc[0];
        }
        QType::Q8_0R => {
            let mut acc = [lanes.acc];
            super::q8_0r::rows::<1, R>([row.as_ptr()], k, x, p, &mut acc);
            lanes.acc = acc[0];
        }
        QType::Q4_1R => {
            let (mut acc, mut mins) = ([lanes.acc], [lanes.mins]);
            super::q4_1r::rows::<1, R>([row.as_ptr()], k, x, p, &mut acc, &mut mins);
            (lanes.acc, lanes.mins) = (acc[0], mins[0]);
        }
        _ => unreachable!("{} is not a quantized type", t.name()),
    }
    lanes.totals()
}
