//! `vnni`'s decode products four weight rows a pass, for one row of x (single-stream decode):
//! x's byte planes are loaded once for the four rows, and x's scales and code sums once a
//! group. At k = 576 (SmolLM2) a row is 18 blocks, and the work per weight row (the call, the
//! loads of x, the per-group setup) weighs as much as the `vpdpbusd`s; sharing it is what
//! llama.cpp's interleaved kernels do. Each weight row keeps its own integer sums (exact, any
//! order) and the very f32 steps of `vnni::row_dots_vnni::<1>` in the same order, so each
//! result equals it (and `int16::row_dot`) bit for bit.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::formats::QType;
use super::int16::avx2::{add, bytes32, f16s, load8, Lanes};
use super::int16::Row;
use super::vnni::{
    codes64, load_i32, prefetch_ahead, prefetch_rows, reduce_pairs, reduce_quads, PlaneRow,
};

/// Weight rows a pass.
pub const ROWS: usize = 4;
/// Elements per block of x.
const QK: usize = 32;
/// ggml's type code of Q4_0 (`codes64` and `bytes32` take codes).
const Q4_0: u32 = 2;

/// Whether the decode path takes rows of `t` four a pass: Q4_0, as stored or repacked
/// (`QType::Q4_0R`, `q4_0r_rows`), and repacked Q5_0 (`QType::Q5_0R`, `q5_0r_rows`: its codes
/// are a load and two masked adds, no more registers than Q4_0R's), and repacked Q8_0
/// (`QType::Q8_0R`, `super::q8_0r::rows`: one load and a xor a two blocks) and repacked Q4_1
/// (`QType::Q4_1R`, `super::q4_1r::rows`: Q4_0R's loads, the mins one 16-byte load a group),
/// and Q4_K and Q6_K as stored (`super::kquant4`: a super-block's scales once a row, x's planes
/// once for the four). Units for the other stored 32-element types were built and tested bit
/// for bit, but SmolLM2's products per step measured slower four a pass (Q4_1 file 0.79x,
/// Q4_K_M file, mostly Q5_0: 0.66x; Q4_0 1.11x; busy, thread CPU time; benches/RESULTS.md,
/// "four weight rows a pass"): their extra codes and scales for four rows exceed the
/// registers, so they were removed rather than kept unused.
pub fn takes(t: QType) -> bool {
    matches!(
        t,
        QType::Q4_0
            | QType::Q4_0R
            | QType::Q5_0R
            | QType::Q8_0R
            | QType::Q4_1R
            | QType::Q4_K
            | QType::Q6_K
    )
}

/// Per weight row, the 16 i32 lanes of its 64 codes (`w`, unsigned, against both planes)
/// times x's elements `e..e + 64`, x's planes loaded once.
#[inline(always)]
unsafe fn dots(w: [__m512i; ROWS], p: &PlaneRow<'_>, e: usize) -> [__m512i; ROWS] {
    // elements e..e + 64: inside the row's k + PAD bytes (e + 32 < k)
    let hi = _mm512_loadu_si512(p.hi.add(e).cast());
    let lo = _mm512_loadu_si512(p.lo.add(e).cast());
    let mut out = [_mm512_setzero_si512(); ROWS];
    for (o, w) in out.iter_mut().zip(w) {
        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, hi);
        *o = _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(s), lo, w);
    }
    out
}

/// `vnni::group32` for four Q4_0 weight rows (`b`: each one's block `blk0`), blocks
/// `blk0..blk0 + n` (`n` <= 8).
#[inline(always)]
unsafe fn group(
    b: [*const u8; ROWS],
    blk0: usize,
    n: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let bytes = bytes32(Q4_0);
    let mut z = [[_mm512_setzero_si512(); 4]; ROWS];
    for j in 0..4 {
        let first = 2 * j;
        if first >= n {
            break;
        }
        let two = first + 1 < n;
        let mut w = [_mm512_setzero_si512(); ROWS];
        for (w, b) in w.iter_mut().zip(b) {
            *w = codes64::<Q4_0>(b.add(first * bytes), two);
        }
        let d = dots(w, p, QK * (blk0 + first));
        for (z, d) in z.iter_mut().zip(d) {
            z[j] = d;
        }
    }
    // x's parts shared by the four rows: Q4_0's codes are stored + 8, so 8 x's code sums
    let offset = _mm256_slli_epi32::<3>(load_i32(p.sum32, blk0, n));
    let dx = load8(x.d, blk0, n);
    for (r, (z, b)) in z.into_iter().zip(b).enumerate() {
        let s = _mm256_sub_epi32(reduce_pairs(z), offset);
        let c = _mm256_mul_ps(f16s(b, bytes, 0, n), dx);
        let mut acc = [lanes.acc[r]];
        add([s], [c], &mut acc);
        lanes.acc[r] = acc[0];
    }
}

/// Four Q4_0 rows, 8 blocks at a time.
#[inline(always)]
unsafe fn q4_0_rows(
    rows: [*const u8; ROWS],
    k: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let (blocks, bytes) = (k / QK, bytes32(Q4_0));
    // whole groups with n = 8 known (the scales' gather unrolled, no branch), then the rest
    let mut blk = 0;
    while blk + 8 <= blocks {
        // blocks blk..blk + 8 of each row: inside it
        let b = rows.map(|r| r.add(blk * bytes));
        group(b, blk, 8, x, p, lanes);
        blk += 8;
    }
    if blk < blocks {
        let b = rows.map(|r| r.add(blk * bytes));
        group(b, blk, blocks - blk, x, p, lanes);
    }
}

/// `vnni::row_dots_vnni::<1>` of each of the four weight rows `rows` (type `t`) with the row of
/// x `x` (its codes) / `p` (its planes): the same bits, x read once for the four.
///
/// # Safety
/// The process runs at AVX-512 with VNNI (`super::vnni()`); `vnni::decodes(t)` (not Q8_0, not
/// a float type); each of `rows` holds
/// `k` elements of `t` and x `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn rows_dots_vnni(
    t: QType,
    rows: [&[u8]; ROWS],
    k: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
) -> [f32; ROWS] {
    let mut lanes = Lanes {
        acc: [_mm256_setzero_ps(); ROWS],
        mins: [_mm256_setzero_ps(); ROWS],
    };
    let w = rows.map(<[u8]>::as_ptr);
    match t {
        QType::Q4_0 => q4_0_rows(w, k, x, p, &mut lanes),
        QType::Q4_0R => {
            let mut acc = lanes.acc.map(|a| [a]);
            q4_0r_rows::<ROWS, 1>(w, k, &[*x], &[*p], &mut acc);
            lanes.acc = acc.map(|a| a[0]);
        }
        QType::Q5_0R => {
            let mut acc = lanes.acc.map(|a| [a]);
            q5_0r_rows::<ROWS, 1>(w, k, &[*x], &[*p], &mut acc);
            lanes.acc = acc.map(|a| a[0]);
        }
        QType::Q4_1R => {
            // `super::q4_1r`: x's permuted planes; the mins in their own lanes
            let mut acc = [[_mm256_setzero_ps()]; ROWS];
            let mut mins = [[_mm256_setzero_ps()]; ROWS];
            super::q4_1r::rows::<ROWS, 1>(w, k, &[*x], &[*p], &mut acc, &mut mins);
            for (r, (a, m)) in acc.iter().zip(&mins).enumerate() {
                (lanes.acc[r], lanes.mins[r]) = (a[0], m[0]);
            }
        }
        QType::Q8_0R => {
            // `super::q8_0r`: x's planes in its order
            let mut acc = lanes.acc.map(|a| [a]);
            super::q8_0r::rows::<ROWS, 1>(w, k, &[*x], &[*p], &mut acc);
            lanes.acc = acc.map(|a| a[0]);
        }
        QType::Q4_K => {
            // `super::kquant4`: the stored layout, x's natural planes
            let mut acc = [[_mm256_setzero_ps()]; ROWS];
            let mut mins = [[_mm256_setzero_ps()]; ROWS];
            super::kquant4::q4_k_rows::<ROWS, 1>(w, k, &[*x], &[*p], &mut acc, &mut mins);
            for (r, (a, m)) in acc.iter().zip(&mins).enumerate() {
                (lanes.acc[r], lanes.mins[r]) = (a[0], m[0]);
            }
        }
        QType::Q6_K => {
            let mut acc = lanes.acc.map(|a| [a]);
            super::kquant4::q6_k_rows::<ROWS, 1>(w, k, &[*x], &[*p], &mut acc);
            lanes.acc = acc.map(|a| a[0]);
        }
        _ => panic!("{} is not taken four rows a pass", t.name()),
    }
    lanes.totals()
}

/// Each of the `W` repacked Q4_0 rows `w` (`QType::Q4_0R`, `k` elements) times each of the `R`
/// rows of x (`x` codes, `p` planes permuted): `acc[i][r]` takes row i's scaled unit sums with
/// row r of x, a group of 8 blocks at a time, as `vnni::group32` (the same integer sums, the
/// same f32 steps in the same order: the same bits as Q4_0's products).
///
/// A group is 4 blocks' nibbles a 64-byte load: its low nibbles are the 4 blocks' elements
/// 0-15, its high nibbles their elements 16-31, which meet x's permuted planes; both
/// products land in the same i32 lanes (lanes 4b..4b + 3: block b), so a block's sum is one
/// 128-bit lane (`reduce_quads`).
///
/// # Safety
/// AVX-512 with VNNI; each row of `w` holds `k` elements of Q4_0R; `p` permuted
/// (`Planes::new(.., true)`); x's rows `k` elements.
#[inline(always)]
pub(super) unsafe fn q4_0r_rows<const W: usize, const R: usize>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
) {
    repacked_rows::<W, R, false>(w, k, x, p, acc);
}

/// `q4_0r_rows` for repacked Q5_0 rows (`QType::Q5_0R`): the same, each 64 codes' bits 4 added
/// from one 64-bit mask (4 blocks' qh halves, stored together by the repack), the offset 16
/// taken off; full groups in their own layout (`q5_0r_full_group`); the same bits as Q5_0's
/// products (`vnni::group32`).
///
/// # Safety
/// As `q4_0r_rows`, the rows Q5_0R, x's planes in Q5_0R's order as well (`Planes::new`'s
/// types with `QType::Q5_0R`).
#[inline(always)]
pub(super) unsafe fn q5_0r_rows<const W: usize, const R: usize>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
) {
    repacked_rows::<W, R, true>(w, k, x, p, acc);
}

/// `q4_0r_rows` (Q4_0R) or, `FIVE`, `q5_0r_rows` (Q5_0R).
#[inline(always)]
unsafe fn repacked_rows<const W: usize, const R: usize, const FIVE: bool>(
    w: [*const u8; W],
    k: usize,
    x: &[Row<'_>; R],
    p: &[PlaneRow<'_>; R],
    acc: &mut [[__m256; R]; W],
) {
    let blocks = k / QK;
    // bytes a block, and a group's bytes before its nibbles per block (scale, qh halves)
    let (block, head) = if FIVE { (22, 6) } else { (18, 2) };
    let ahead = prefetch_ahead(blocks * block, W);
    let nibble = _mm512_set1_epi8(0xF);
    let sixteen = _mm512_set1_epi8(16);
    let mut blk0 = 0;
    while blk0 < blocks {
        let n = (blocks - blk0).min(8);
        // group blk0 / 8 of each row: `block` bytes a block before it
        let g = w.map(|r| r.add(blk0 * block));
        prefetch_rows(g, ahead, 8 * block);
        let mut z = [[[_mm512_setzero_si512(); 2]; R]; W];
        let full = FIVE && n == 8;
        if full {
            z = q5_0r_full_group(g, p, blk0);
        }
        for c in 0..2 {
            if full {
                break;
            }
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
            let valid = if n4 == 4 {
                u64::MAX
            } else {
                (1u64 << (16 * n4)) - 1
            };
            for (z, g) in z.iter_mut().zip(g) {
                // blocks first..first + n4's nibbles: the group's heads, then 16 a block
                let at = g.add(head * n + 16 * first);
                let v = if n4 == 4 {
                    _mm512_loadu_si512(at.cast())
                } else {
                    _mm512_maskz_loadu_epi8(valid, at.cast())
                };
                let mut lo = _mm512_and_si512(v, nibble);
                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                if FIVE {
                    // the blocks' qh low halves (2 bytes a block from 2n), then high halves
                    // (from 4n): inside the group, its nibbles follow
                    let qh = g.add(2 * n + 2 * first);
                    let bits_lo = qh.cast::<u64>().read_unaligned() & valid;
                    let bits_hi = qh.add(2 * n).cast::<u64>().read_unaligned() & valid;
                    lo = _mm512_mask_add_epi8(lo, bits_lo, lo, sixteen);
                    hi = _mm512_mask_add_epi8(hi, bits_hi, hi, sixteen);
                }
                for (z, q) in z.iter_mut().zip(&planes) {
                    let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, q[0]);
                    let s = _mm512_slli_epi32::<8>(_mm512_dpbusd_epi32(s, hi, q[1]));
                    let s = _mm512_dpbusd_epi32(s, q[2], lo);
                    z[c] = _mm512_dpbusd_epi32(s, q[3], hi);
                }
            }
        }
        // from here as `vnni::group32` for Q4_0 / Q5_0: codes stored + 8 / + 16, so 8 / 16
        // x's code sums off
        let mut offset = [_mm256_setzero_si256(); R];
        let mut dx = [_mm256_setzero_ps(); R];
        for ((o, d), (x, p)) in offset.iter_mut().zip(&mut dx).zip(x.iter().zip(p)) {
            let sums = load_i32(p.sum32, blk0, n);
            *o = if FIVE {
                _mm256_slli_epi32::<4>(sums)
            } else {
                _mm256_slli_epi32::<3>(sums)
            };
            *d = load8(x.d, blk0, n);
        }
        for ((acc, z), g) in acc.iter_mut().zip(z).zip(g) {
            let dw = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(((1u32 << n) - 1) as u8, g.cast()));
            let mut s = [_mm256_setzero_si256(); R];
            let mut c = [dw; R];
            for (((s, c), z), (o, d)) in s.iter_mut().zip(&mut c).zip(z).zip(offset.iter().zip(dx))
            {
                let sums = if full {
                    // block b in lanes b and b + 8
                    _mm256_add_epi32(
                        _mm512_castsi512_si256(z[0]),
                        _mm512_extracti64x4_epi64::<1>(z[0]),
                    )
                } else {
                    reduce_quads(z[0], z[1])
                };
                *s = _mm256_sub_epi32(sums, *o);
                *c = _mm256_mul_ps(dw, d);
            }
            add(s, c, acc);
        }
        blk0 += 8;
    }
}

/// A full Q5_0R group (8 blocks from `blk0`, `repack::q5_0_masks_and_words`) of each weight row
/// `g` by each row of x (planes in Q5_0R's order): per half c of the nibbles one 64-byte load
/// (words 2c, 2c + 1 of all 8 blocks), its low and high nibbles' bits 4 one masked add each,
/// all products added to one accumulator a row pair, so block b's integer sum is lanes b and
/// b + 8 of `[0]` (`[1]` unused).
#[inline(always)]
unsafe fn q5_0r_full_group<const W: usize, const R: usize>(
    g: [*const u8; W],
    p: &[PlaneRow<'_>; R],
    blk0: usize,
) -> [[[__m512i; 2]; R]; W] {
    let nibble = _mm512_set1_epi8(0xF);
    let sixteen = _mm512_set1_epi8(16);
    let mut hi = [[_mm512_setzero_si512(); R]; W];
    let mut lo = [[_mm512_setzero_si512(); R]; W];
    for c in 0..2 {
        // x's 128 elements of half c, in the group's order: inside the planes' k + PAD
        let e = QK * blk0 + 128 * c;
        let mut planes = [[_mm512_setzero_si512(); 4]; R];
        for (q, p) in planes.iter_mut().zip(p) {
            *q = [
                _mm512_loadu_si512(p.nhi.add(e).cast()),
                _mm512_loadu_si512(p.nhi.add(e + 64).cast()),
                _mm512_loadu_si512(p.nlo.add(e).cast()),
                _mm512_loadu_si512(p.nlo.add(e + 64).cast()),
            ];
        }
        for ((hi, lo), g) in hi.iter_mut().zip(&mut lo).zip(g) {
            // the 16 bytes of scales, the 4 masks (32), then the nibbles: inside the group
            let masks = g.add(16 + 16 * c);
            let v = _mm512_loadu_si512(g.add(48 + 64 * c).cast());
            let (m0, m1) = (
                masks.cast::<u64>().read_unaligned(),
                masks.add(8).cast::<u64>().read_unaligned(),
            );
            let w0 = _mm512_and_si512(v, nibble);
            let w1 = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
            let w0 = _mm512_mask_add_epi8(w0, m0, w0, sixteen);
            let w1 = _mm512_mask_add_epi8(w1, m1, w1, sixteen);
            for ((hi, lo), q) in hi.iter_mut().zip(lo.iter_mut()).zip(&planes) {
                *hi = _mm512_dpbusd_epi32(*hi, w0, q[0]);
                *hi = _mm512_dpbusd_epi32(*hi, w1, q[1]);
                *lo = _mm512_dpbusd_epi32(*lo, q[2], w0);
                *lo = _mm512_dpbusd_epi32(*lo, q[3], w1);
            }
        }
    }
    let mut z = [[[_mm512_setzero_si512(); 2]; R]; W];
    for ((z, hi), lo) in z.iter_mut().zip(hi).zip(lo) {
        for ((z, hi), lo) in z.iter_mut().zip(hi).zip(lo) {
            z[0] = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
        }
    }
    z
}
