//! Repacked Q8_0 rows (`QType::Q8_0R`, `repack`) times rows of x's 16-bit codes on the VNNI
//! units: `W` weight rows by `R` rows of x a pass (single-stream decode: four weight rows by one
//! row of x, x's planes loaded once for the four; 2-8 rows of x: four weight rows by two).
//!
//! A Q8_0 block is an f16 scale and 32 signed codes (34 bytes), so as stored two blocks' codes
//! are two 32-byte loads 34 bytes apart and 8 scales a gather; on AVX2 each block is widened to
//! 16 bits and taken by two `vpmaddwd` (SmolLM2 Q8_0, one thread: ~70 % of a decode step in
//! those units and their per-row calls). Repacked, a group of 8 blocks is its `n` scales (2n
//! bytes) then its blocks' codes (32n bytes), 8 scales one 16-byte load. A full group's codes
//! are its blocks' 4-byte words transposed (word j of block b at word 8j + b), read against x's
//! planes in the same order (`vnni::Planes::new(.., transposed)`): each of the 4 64-byte loads
//! holds words 2t, 2t + 1 of all 8 blocks, so over the group block b's products add up in lanes
//! b and b + 8 of one accumulator a product (high and low bytes of x), and the 8 block sums are
//! one fold of 256 bits, with no reduction per load. A short last group keeps its blocks' codes
//! in order (two blocks a load, each load's lanes reduced: `reduce_pairs`).
//!
//! The integer sums are `vnni::group32`'s for Q8_0 (the codes shifted by 128 to unsigned
//! against x's high bytes, signed against the low bytes, `hsum` off; exact in any order: per lane
//! at most 16 · 255 · 128 · 256 + 16 · 128 · 255 < 2^31) and the f32 steps those of
//! `int16::avx2::group32` in the same order, so every result equals `int16::row_dot` on the
//! plain Q8_0 row bit for bit.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::int16::avx2::{add, load8};
use super::int16::Row;
use super::vnni::{load_i32, prefetch_rows, reduce_pairs, PlaneRow};

/// Elements per block.
const QK: usize = 32;
/// Bytes per block (as Q8_0's).
const BLOCK: usize = 34;
/// Weight rows ahead of the current ones whose group is prefetched (four passes of four): from
/// memory the hardware prefetcher alone does not keep several rows streaming (round 9, H1's
/// kernel benchmark on Q4_0R). SmolLM2 Q8_0's matrices from huge pages, one row of x, one
/// thread: 8 rows ahead 23-27 GB/s, 12: 26-30, 16-32: 30-31, 48-64: 26-30 (busy; benches/
/// RESULTS.md, round 10, HC).
const PREFETCH_ROWS: usize = 16;

/// Each of the `W` repacked Q8_0 rows `w` (`k` elements) times each of the `R` rows of x (`x`
/// codes, `p` planes with Q8_0R's order): `acc[i][r]` takes row i's scaled unit sums with row r
/// of x, a group of 8 blocks at a time, as `vnni::group32` for Q8_0 (the same integer sums and
/// f32 steps in the same order).
///
/// # Safety
/// AVX-512 with VNNI (`super::vnni()`), avx2, fma, f16c; each row of `w` holds `k` elements of
/// Q8_0R (`k` a multiple of 32); x's rows `k` elements, their planes `k + PAD` bytes in both
/// orders (`Planes::new(.., true)`).
#[inline(always)]
pub(super) unsafe fn rows<const W: usize, const R: usize>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
) {
    let blocks = k / QK;
    let ahead = PREFETCH_ROWS * blocks * BLOCK;
    let mut blk0 = 0;
    while blk0 < blocks {
        let n = (blocks - blk0).min(8);
        // group blk0 / 8 of each row: `BLOCK` bytes a block before it
        let g = w.map(|r| r.add(blk0 * BLOCK));
        prefetch_rows(g, ahead, 8 * BLOCK);
        let sums = if n == 8 {
            full_group(g, p, blk0)
        } else {
            short_group(g, n, p, blk0)
        };
        // from here as `vnni::group32` for Q8_0
        let mut dx = [_mm256_setzero_ps(); R];
        let mut hsum = [_mm256_setzero_si256(); R];
        for ((d, h), (x, p)) in dx.iter_mut().zip(&mut hsum).zip(x.iter().zip(p)) {
            *d = load8(x.d, blk0, n);
            *h = load_i32(p.hsum, blk0, n);
        }
        for ((acc, sums), g) in acc.iter_mut().zip(sums).zip(g) {
            let dw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(((1u32 << n) - 1) as u8, g.cast()));
            let mut s = [_mm256_setzero_si256(); R];
            let mut c = [dw; R];
            for (((s, c), sums), (h, d)) in
                s.iter_mut().zip(&mut c).zip(sums).zip(hsum.iter().zip(dx))
            {
                *s = _mm256_sub_epi32(sums, *h);
                *c = _mm256_mul_ps(dw, d);
            }
            add(s, c, acc);
        }
        blk0 += 8;
    }
}

/// A full group (8 blocks from `blk0`; the codes transposed) of each weight row `g` by each row
/// of x: the 8 blocks' integer sums (x's high bytes against the codes shifted by 128), block b
/// in lane b.
#[inline(always)]
unsafe fn full_group<const W: usize, const R: usize>(
    g: [*const u8; W],
    p: &[PlaneRow<'_>; R],
    blk0: usize,
) -> [[__m256i; R]; W] {
    let flip = _mm512_set1_epi8(-128);
    let mut hi = [[_mm512_setzero_si512(); R]; W];
    let mut lo = [[_mm512_setzero_si512(); R]; W];
    for t in 0..4 {
        // words 2t, 2t + 1 of each block: x's elements in the same order
        let e = QK * blk0 + 64 * t;
        let mut planes = [[_mm512_setzero_si512(); 2]; R];
        for (q, p) in planes.iter_mut().zip(p) {
            *q = [
                _mm512_loadu_si512(p.thi.add(e).cast()),
                _mm512_loadu_si512(p.tlo.add(e).cast()),
            ];
        }
        for ((hi, lo), g) in hi.iter_mut().zip(&mut lo).zip(g) {
            // after the group's 16 bytes of scales
            let codes = _mm512_loadu_si512(g.add(16 + 64 * t).cast());
            let shifted = _mm512_xor_si512(codes, flip);
            for ((hi, lo), q) in hi.iter_mut().zip(lo.iter_mut()).zip(&planes) {
                *hi = _mm512_dpbusd_epi32(*hi, shifted, q[0]);
                *lo = _mm512_dpbusd_epi32(*lo, q[1], codes);
            }
        }
    }
    let mut out = [[_mm256_setzero_si256(); R]; W];
    for ((o, hi), lo) in out.iter_mut().zip(hi).zip(lo) {
        for ((o, hi), lo) in o.iter_mut().zip(hi).zip(lo) {
            let z = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
            *o = _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64::<1>(z));
        }
    }
    out
}

/// A short last group (`n` < 8 blocks from `blk0`, the codes in block order) of each weight row
/// `g` by each row of x: as `full_group`, two blocks a load, each load's lanes reduced.
#[inline(always)]
unsafe fn short_group<const W: usize, const R: usize>(
    g: [*const u8; W],
    n: usize,
    p: &[PlaneRow<'_>; R],
    blk0: usize,
) -> [[__m256i; R]; W] {
    let flip = _mm512_set1_epi8(-128);
    let mut z = [[[_mm512_setzero_si512(); 4]; R]; W];
    for j in 0..4 {
        let first = 2 * j;
        if first >= n {
            break;
        }
        let two = first + 1 < n;
        // x's elements of blocks blk0 + first, + 1 (a short group's order is the natural one):
        // inside the planes' k + PAD bytes
        let e = QK * (blk0 + first);
        let mut planes = [[_mm512_setzero_si512(); 2]; R];
        for (q, p) in planes.iter_mut().zip(p) {
            *q = [
                _mm512_loadu_si512(p.hi.add(e).cast()),
                _mm512_loadu_si512(p.lo.add(e).cast()),
            ];
        }
        for (z, g) in z.iter_mut().zip(g) {
            // blocks first, first + 1's codes: after the group's 2n bytes of scales
            let at = g.add(2 * n + QK * first);
            let (codes, shifted) = if two {
                let v = _mm512_loadu_si512(at.cast());
                (v, _mm512_xor_si512(v, flip))
            } else {
                // one block: the missing one's lanes 0 in both operands
                let v = _mm512_zextsi256_si512(_mm256_loadu_si256(at.cast()));
                (v, _mm512_maskz_xor_epi32(0x00FF, v, flip))
            };
            for (z, q) in z.iter_mut().zip(&planes) {
                let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), shifted, q[0]);
                z[j] = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(s), q[1], codes);
            }
        }
    }
    let mut out = [[_mm256_setzero_si256(); R]; W];
    for (o, z) in out.iter_mut().zip(z) {
        for (o, z) in o.iter_mut().zip(z) {
            *o = reduce_pairs(z);
        }
    }
    out
}

/// A Q8_0R row (`q.len()` elements) as its 16-bit codes in element order: the integer panels'
/// widening (`int16::avx2::row_codes`) at AVX-512, a full group's transposed words put back in
/// block order by 8 two-source permutes (4 blocks' words 0-3 and 4-7, then two blocks a vector)
/// and widened two blocks a vector; a short group's blocks widened as they are.
///
/// # Safety
/// AVX-512 F and BW; `row` holds `q.len()` elements of Q8_0R.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
pub(super) unsafe fn codes(row: &[u8], q: &mut [i16]) {
    let blocks = q.len() / QK;
    assert!(row.len() >= blocks * BLOCK && q.len() == blocks * QK);
    // lane 4i + j: word j (0-3, of two vectors' 32) of block h + i, for the blocks from h = 0
    // and from h = 4
    let quarter = |h: i32| {
        _mm512_setr_epi32(
            h,
            8 + h,
            16 + h,
            24 + h,
            h + 1,
            9 + h,
            17 + h,
            25 + h,
            h + 2,
            10 + h,
            18 + h,
            26 + h,
            h + 3,
            11 + h,
            19 + h,
            27 + h,
        )
    };
    let firsts = [quarter(0), quarter(4)];
    // two blocks' 8 words each: words 0-3 from the first vector, 4-7 from the second
    let pairs = [
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31),
    ];
    let mut blk0 = 0;
    while blk0 < blocks {
        let n = (blocks - blk0).min(8);
        // group blk0 / 8 and its blocks' codes in q: inside both
        let g = row.as_ptr().add(blk0 * BLOCK);
        let out = q.as_mut_ptr().add(QK * blk0);
        if n == 8 {
            let mut v = [_mm512_setzero_si512(); 4];
            for (i, v) in v.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(g.add(16 + 64 * i).cast());
            }
            for (h, first) in firsts.iter().enumerate() {
                let low = _mm512_permutex2var_epi32(v[0], *first, v[1]);
                let high = _mm512_permutex2var_epi32(v[2], *first, v[3]);
                for (i, pair) in pairs.iter().enumerate() {
                    let two = _mm512_permutex2var_epi32(low, *pair, high);
                    let at = out.add(QK * (4 * h + 2 * i));
                    let (a, b) = (
                        _mm512_castsi512_si256(two),
                        _mm512_extracti64x4_epi64::<1>(two),
                    );
                    _mm512_storeu_si512(at.cast(), _mm512_cvtepi8_epi16(a));
                    _mm512_storeu_si512(at.add(QK).cast(), _mm512_cvtepi8_epi16(b));
                }
            }
        } else {
            for j in 0..n {
                let c = _mm256_loadu_si256(g.add(2 * n + QK * j).cast());
                _mm512_storeu_si512(out.add(QK * j).cast(), _mm512_cvtepi8_epi16(c));
            }
        }
        blk0 += n;
    }
}
