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
    // two sums, x's high and low bytes', added up over the group; with one row of x (8 chains
    // of 4 dependent `vpdpbusd`s) single-stream decode waited on them (SmolLM2 Q8_0, 1 thread:
    // 0.89x the per-load reductions' tok/s), so there each load's products are their own and
    // only their sum is carried (0.95x; the 8 chains are still 1.03x at 8 rows of x)
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
                if R == 1 {
                    // lo carries the sum
                    *lo = _mm512_add_epi32(*lo, load_products(codes, shifted, q));
                } else {
                    *hi = _mm512_dpbusd_epi32(*hi, shifted, q[0]);
                    *lo = _mm512_dpbusd_epi32(*lo, q[1], codes);
                }
            }
        }
    }
    let mut out = [[_mm256_setzero_si256(); R]; W];
    for ((o, hi), lo) in out.iter_mut().zip(hi).zip(lo) {
        for ((o, hi), lo) in o.iter_mut().zip(hi).zip(lo) {
            // hi is 0 with one row of x
            let z = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
            *o = _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64::<1>(z));
        }
    }
    out
}

/// One load's integer products with x's planes `q` (high bytes, low bytes): the codes shifted
/// by 128 against the high bytes, moved up 8 bits, plus the signed codes against the low bytes.
#[inline(always)]
unsafe fn load_products(codes: __m512i, shifted: __m512i, q: &[__m512i; 2]) -> __m512i {
    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), shifted, q[0]);
    _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(s), q[1], codes)
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
                z[j] = load_products(codes, shifted, q);
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

/// `group_codes`' first permutes: lane 4i + j is word j (0-3, of two vectors' 32) of block
/// h + i, for the blocks from h = 0 and from h = 4.
static FIRSTS: [[i32; 16]; 2] = {
    let mut t = [[0; 16]; 2];
    let mut l = 0;
    while l < 32 {
        let (h, i, j) = (l / 16, l % 16 / 4, l % 4);
        t[h][l % 16] = (4 * h + i + 8 * j) as i32;
        l += 1;
    }
    t
};

/// `group_codes`' second permutes: two blocks' 8 words each, words 0-3 from the first vector,
/// 4-7 from the second.
static PAIRS: [[i32; 16]; 2] = [
    [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23],
    [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31],
];

/// A full Q8_0R or (`five`) Q5_0R group at `g` (8 blocks, `repack`'s layouts) as its 256
/// 16-bit codes in element order at `out` (Q5_0's less its offset 16, as `int16`'s
/// `q5_0_weights`): the integer panels' widening (`int16::avx2::row_codes`) at AVX-512. The
/// group's codes are 4 64-byte vectors of 4-byte words, word l of vector v word j of block
/// l % 8 (Q8_0R: j = 2v + l / 8; Q5_0R: vector (c, h) = 2h + c its low (h = 0) or high nibbles'
/// half c, j = 2c + l / 8, elements 16h + 4j..), put back in block order by 8 two-source
/// permutes (4 blocks' words from the first two vectors, then from the last two; then two
/// blocks a vector) and widened two blocks a vector.
///
/// # Safety
/// AVX-512 F and BW; `g` a full group of its type, `out` writable for 256 codes.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
pub(super) unsafe fn group_codes(g: *const u8, five: bool, out: *mut i16) {
    let mut v = [_mm512_setzero_si512(); 4];
    if five {
        // the 16 bytes of scales, 4 masks (32 bytes: half c's low nibbles', high nibbles'),
        // then the nibbles' two halves
        let (nibble, sixteen) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(16));
        for c in 0..2 {
            let half = _mm512_loadu_si512(g.add(48 + 64 * c).cast());
            let masks = g.add(16 + 16 * c);
            for h in 0..2 {
                let w = if h == 0 {
                    _mm512_and_si512(half, nibble)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(half), nibble)
                };
                let bits = masks.add(8 * h).cast::<u64>().read_unaligned();
                let w = _mm512_mask_add_epi8(w, bits, w, sixteen);
                v[2 * h + c] = _mm512_sub_epi8(w, sixteen);
            }
        }
    } else {
        for (i, v) in v.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(g.add(16 + 64 * i).cast());
        }
    }
    let (mut firsts, mut pairs) = ([_mm512_setzero_si512(); 2], [_mm512_setzero_si512(); 2]);
    for (f, i) in firsts.iter_mut().zip(&FIRSTS) {
        *f = _mm512_loadu_si512(i.as_ptr().cast());
    }
    for (p, i) in pairs.iter_mut().zip(&PAIRS) {
        *p = _mm512_loadu_si512(i.as_ptr().cast());
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
}
