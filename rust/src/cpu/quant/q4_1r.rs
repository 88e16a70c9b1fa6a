//! Repacked Q4_1 rows (`QType::Q4_1R`, `repack`) times rows of x's 16-bit codes on the VNNI
//! units: `W` weight rows by `R` rows of x a pass (single-stream decode: four weight rows by one
//! row of x, x's permuted planes loaded once for the four).
//!
//! As stored, a Q4_1 row's nibbles come in 16-byte pieces 20 bytes apart and its scales and
//! mins 2 bytes 20 apart: the VNNI products took one weight row a call (two loads, an insert
//! and a shift per 64 codes, 8 scales and 8 mins gathered word by word; four a pass spilled).
//! Repacked, a group of 8 blocks is its `n` scales, its `n` mins, then the nibbles as Q4_0R's:
//! 4 blocks' nibbles one 64-byte load against x's planes in Q4_0R's order
//! (`vnni::Planes::new(.., permuted)`), 8 scales and 8 mins a 16-byte load each.
//!
//! The integer sums are `vnni::group32`'s for Q4_1 (unsigned codes, no offset) and the f32
//! steps those of `int16::avx2::group32` (the scaled unit sums into `acc`, each block's min
//! times x's block sum into `mins`) in the same order, so every result equals `int16::row_dot`
//! on the plain Q4_1 row bit for bit.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::int16::avx2::{add, load8};
use super::int16::Row;
use super::vnni::{prefetch_rows, reduce_quads, PlaneRow};

/// Elements per block.
const QK: usize = 32;
/// Bytes per block (as Q4_1's).
const BLOCK: usize = 20;
/// Weight rows ahead of the current ones whose group is prefetched (as `q8_0r`'s, in rows).
const PREFETCH_ROWS: usize = 16;

/// Each of the `W` repacked Q4_1 rows `w` (`k` elements) times each of the `R` rows of x (`x`
/// codes, `p` permuted planes): `acc[i][r]` takes row i's scaled unit sums with row r of x and
/// `mins[i][r]` its mins times x's block sums, a group of 8 blocks at a time.
///
/// # Safety
/// AVX-512 with VNNI (`super::vnni()`), avx2, fma, f16c; each row of `w` holds `k` elements of
/// Q4_1R (`k` a multiple of 32); x's rows `k` elements, their planes permuted.
#[inline(always)]
pub(super) unsafe fn rows<const W: usize, const R: usize>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
    mins: &mut [[__m256; R]; W],
) {
    let blocks = k / QK;
    let ahead = PREFETCH_ROWS * blocks * BLOCK;
    let nibble = _mm512_set1_epi8(0xF);
    let mut blk0 = 0;
    while blk0 < blocks {
        let n = (blocks - blk0).min(8);
        // group blk0 / 8 of each row: `BLOCK` bytes a block before it
        let g = w.map(|r| r.add(blk0 * BLOCK));
        prefetch_rows(g, ahead, 8 * BLOCK);
        let mut z = [[[_mm512_setzero_si512(); 2]; R]; W];
        for c in 0..2 {
            let first = 4 * c;
            if first >= n {
                break;
            }
            let n4 = (n - first).min(4);
            // x's 128 permuted elements of blocks blk0 + first..: inside the planes' kp
            let e = QK * (blk0 + first);
            let mut planes = [[_mm512_setzero_si512(); 4]; R];
            for (q, p) in planes.iter_mut().zip(p) {
                *q = [
                    _mm512_loadu_si512(p.phi.add(e).cast()),
                    _mm512_loadu_si512(p.phi.add(e + 64).cast()),
                    _mm512_loadu_si512(p.plo.add(e).cast()),
                    _mm512_loadu_si512(p.plo.add(e + 64).cast()),
                ];
            }
            for (z, g) in z.iter_mut().zip(g) {
                // blocks first..first + n4's nibbles: after the group's scales and mins
                let at = g.add(4 * n + 16 * first);
                let v = if n4 == 4 {
                    _mm512_loadu_si512(at.cast())
                } else {
                    _mm512_maskz_loadu_epi8((1u64 << (16 * n4)) - 1, at.cast())
                };
                let lo = _mm512_and_si512(v, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                for (z, q) in z.iter_mut().zip(&planes) {
                    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, q[0]);
                    let s = _mm512_slli_epi32::<8>(_mm512_dpbusd_epi32(s, hi, q[1]));
                    let s = _mm512_dpbusd_epi32(s, q[2], lo);
                    z[c] = _mm512_dpbusd_epi32(s, q[3], hi);
                }
            }
        }
        // from here as `vnni::group32` for Q4_1: no offset; the mins by x's block sums
        let mut dx = [_mm256_setzero_ps(); R];
        let mut sx = [_mm256_setzero_ps(); R];
        for ((d, s), x) in dx.iter_mut().zip(&mut sx).zip(x) {
            *d = load8(x.d, blk0, n);
            *s = load8(x.s, blk0, n);
        }
        let valid = ((1u32 << n) - 1) as u8;
        for (((acc, mins), z), g) in acc.iter_mut().zip(mins.iter_mut()).zip(z).zip(g) {
            let dw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(valid, g.cast()));
            let mw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(valid, g.add(2 * n).cast()));
            let mut s = [_mm256_setzero_si256(); R];
            let mut c = [dw; R];
            for ((s, c), (z, d)) in s.iter_mut().zip(&mut c).zip(z.iter().zip(dx)) {
                *s = reduce_quads(z[0], z[1]);
                *c = _mm256_mul_ps(dw, d);
            }
            add(s, c, acc);
            for (m, xs) in mins.iter_mut().zip(sx) {
                *m = _mm256_add_ps(*m, _mm256_mul_ps(mw, xs));
            }
        }
        blk0 += 8;
    }
}
