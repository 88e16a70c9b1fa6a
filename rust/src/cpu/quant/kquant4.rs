//! Q4_K and Q6_K rows times rows of x's 16-bit codes on the VNNI units, `W` weight rows by `R`
//! rows of x a pass: four weight rows by one row of x (single-stream decode) and, at 2-8 rows
//! (`matmul::repacked_passes`), four (Q6_K) or two (Q4_K: four spilled) weight rows by two rows
//! of x, x's planes loaded once for the weight rows.
//!
//! The stored layouts are read as they are (no repack): a Q4_K super-block's 128 bytes of
//! nibbles are 32 bytes a pair of sub-blocks (low nibbles one, high nibbles the next), a Q6_K
//! half's low bits 64 bytes for its four quarters, as `vnni::k_rows` / `vnni::q6_k_rows` load
//! them one weight row a call. What four a pass shares is x's planes and scales per super-block
//! and the per-call work; each weight row's next super-blocks `PREFETCH_ROWS` rows ahead are
//! prefetched (the hardware prefetcher alone does not keep four rows streaming: round 9, H1).
//!
//! The integer sums are `vnni::k_rows`' (Q4_K) and `vnni::q6_k_rows`' (Q6_K), exact in any order,
//! and the f32 steps those of `int16::avx2::k_rows` / `q6_k_rows` in the same order, so every
//! result equals `int16::row_dot` on the row bit for bit.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::dot_avx2::half;
use super::int16::avx2::{add, k_factors};
use super::int16::Row;
use super::vnni::{prefetch_rows, q6_k_half, quads, reduce_quads, PlaneRow};

/// Elements per super-block.
const QK_K: usize = 256;
/// Bytes per Q4_K super-block.
const Q4_K_BYTES: usize = 144;
/// Bytes per Q6_K super-block.
const Q6_K_BYTES: usize = 210;
/// Weight rows ahead of the current ones whose super-block is prefetched (as `q8_0r`'s).
const PREFETCH_ROWS: usize = 16;

/// Each of the `W` Q4_K rows `w` (`k` elements, a multiple of 256) times each of the `R` rows
/// of x (`x` codes, `p` natural planes): `acc[i][r]` takes row i's scaled sub-block sums with
/// row r of x and `mins[i][r]` its mins times x's sub-block sums, a super-block at a time, as
/// `vnni::k_rows::<R, false>`.
///
/// # Safety
/// AVX-512 with VNNI (`super::vnni()`), avx2, fma, f16c; each row of `w` holds `k` elements of
/// Q4_K; x's rows `k` elements, their planes `k + PAD` bytes.
#[inline(always)]
pub(super) unsafe fn q4_k_rows<const W: usize, const R: usize>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
    mins: &mut [[__m256; R]; W],
) {
    let ahead = PREFETCH_ROWS * (k / QK_K) * Q4_K_BYTES;
    let nibble = _mm512_set1_epi8(0xF);
    for sb in 0..k / QK_K {
        // super-block sb of each row: inside it
        let b = w.map(|r| r.add(sb * Q4_K_BYTES));
        prefetch_rows(b, ahead, Q4_K_BYTES);
        // sub-blocks 0-3's lanes folded to quads (`quads`) before 4-7's are taken: fewer
        // registers live at four weight rows by two rows of x
        let mut first = [[_mm512_setzero_si512(); R]; W];
        let mut z = [[[_mm512_setzero_si512(); 2]; R]; W];
        for g in 0..4 {
            // x's elements 64g..64g + 64 of the super-block: inside the rows' k + PAD bytes
            let e = QK_K * sb + 64 * g;
            let mut planes = [[_mm512_setzero_si512(); 2]; R];
            for (q, p) in planes.iter_mut().zip(p) {
                *q = [
                    _mm512_loadu_si512(p.hi.add(e).cast()),
                    _mm512_loadu_si512(p.lo.add(e).cast()),
                ];
            }
            for (z, b) in z.iter_mut().zip(b) {
                // sub-blocks 2g (low nibbles) and 2g + 1 (high nibbles): 32 bytes after the
                // super-block's 16 of scales
                let v = _mm256_loadu_si256(b.add(16 + 32 * g).cast());
                let both =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
                let wv = _mm512_and_si512(both, nibble);
                for (z, q) in z.iter_mut().zip(&planes) {
                    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, q[0]);
                    z[g % 2] = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(s), q[1], wv);
                }
            }
            if g == 1 {
                for (f, z) in first.iter_mut().zip(&z) {
                    for (f, z) in f.iter_mut().zip(z) {
                        *f = quads(z[0], z[1]);
                    }
                }
            }
        }
        // from here as `int16::avx2::k_rows`
        let blk0 = 8 * sb;
        let mut dx = [_mm256_setzero_ps(); R];
        let mut sx = [_mm256_setzero_ps(); R];
        for ((d, s), x) in dx.iter_mut().zip(&mut sx).zip(x) {
            *d = _mm256_loadu_ps(x.d.as_ptr().add(blk0));
            *s = _mm256_loadu_ps(x.s.as_ptr().add(blk0));
        }
        for (((acc, mins), (f, z)), b) in acc
            .iter_mut()
            .zip(mins.iter_mut())
            .zip(first.iter().zip(&z))
            .zip(b)
        {
            let mut s = [_mm256_setzero_si256(); R];
            for ((s, f), z) in s.iter_mut().zip(f).zip(z) {
                *s = reduce_quads(*f, quads(z[0], z[1]));
            }
            let (dl, ml) = k_factors(b);
            let mut c = [dl; R];
            for (c, d) in c.iter_mut().zip(dx) {
                *c = _mm256_mul_ps(dl, d);
            }
            add(s, c, acc);
            for (m, s) in mins.iter_mut().zip(sx) {
                *m = _mm256_add_ps(*m, _mm256_mul_ps(ml, s));
            }
        }
    }
}

/// Each of the `W` Q6_K rows `w` (`k` elements, a multiple of 256) times each of the `R` rows
/// of x (`x` codes, `p` natural planes): `acc[i][r]` takes row i's scaled unit sums (16
/// elements a unit) with row r of x, a half super-block at a time, as `vnni::q6_k_rows::<R>`.
///
/// # Safety
/// As `q4_k_rows`, the rows Q6_K.
#[inline(always)]
pub(super) unsafe fn q6_k_rows<const W: usize, const R: usize>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
) {
    let ahead = PREFETCH_ROWS * (k / QK_K) * Q6_K_BYTES;
    let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for sb in 0..k / QK_K {
        // super-block sb of each row: inside it
        let b = w.map(|r| r.add(sb * Q6_K_BYTES));
        prefetch_rows(b, ahead, Q6_K_BYTES);
        let d = b.map(|b| _mm256_set1_ps(half(b.add(208))));
        for h in 0..2 {
            // x's elements 128h..128h + 128 of the super-block: inside the rows' k + PAD bytes
            let e = QK_K * sb + 128 * h;
            let blk0 = 8 * sb + 4 * h;
            let mut planes = [[_mm512_setzero_si512(); 4]; R];
            let mut offset = [_mm256_setzero_si256(); R];
            let mut dx = [_mm256_setzero_ps(); R];
            for (((q, o), dx), (p, x)) in planes
                .iter_mut()
                .zip(&mut offset)
                .zip(&mut dx)
                .zip(p.iter().zip(x))
            {
                *q = [
                    _mm512_loadu_si512(p.hi.add(e).cast()),
                    _mm512_loadu_si512(p.lo.add(e).cast()),
                    _mm512_loadu_si512(p.hi.add(e + 64).cast()),
                    _mm512_loadu_si512(p.lo.add(e + 64).cast()),
                ];
                // unit u (16 elements) is x's run 2 blk0 + u of 16: its codes' sum 32 times
                let sums = _mm256_loadu_si256(p.sum16.as_ptr().add(2 * blk0).cast());
                *o = _mm256_slli_epi32::<5>(sums);
                let v = _mm_loadu_ps(x.d.as_ptr().add(blk0));
                *dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), pairs);
            }
            for ((acc, b), d) in acc.iter_mut().zip(b).zip(d) {
                let (ql, qh, scales) = (b, b.add(128), b.add(192));
                let (w01, w23) = q6_k_half(ql.add(64 * h), qh.add(32 * h));
                let mut s = [_mm256_setzero_si256(); R];
                for ((s, q), o) in s.iter_mut().zip(&planes).zip(offset) {
                    let z01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w01, q[0]);
                    let z01 = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(z01), q[1], w01);
                    let z23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w23, q[2]);
                    let z23 = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(z23), q[3], w23);
                    *s = _mm256_sub_epi32(reduce_quads(z01, z23), o);
                }
                // from here as `int16::avx2::q6_k_rows`
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    scales.add(8 * h).cast(),
                )));
                let dl = _mm256_mul_ps(d, sc);
                let mut c = [dl; R];
                for (c, dx) in c.iter_mut().zip(dx) {
                    *c = _mm256_mul_ps(dl, dx);
                }
                add(s, c, acc);
            }
        }
    }
}
