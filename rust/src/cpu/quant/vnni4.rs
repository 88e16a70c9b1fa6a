//! `vnni`'s decode products four weight rows a pass, for one row of x (single-stream decode):
//! x's byte planes are loaded once for the four rows, and x's scales and code sums once a
//! group. At k = 576 (SmolLM2) a row is 18 blocks, and the work per weight row (the call, the
//! loads of x, the per-group setup) weighs as much as the `vpdpbusd`s; sharing it is what
//! llama.cpp's interleaved kernels do. Each weight row keeps its own integer sums (exact, any
//! order) and the very f32 steps of `vnni::row_dots_vnni::<1>` in the same order, so each
//! result equals it (and `int16::row_dot`) bit for bit.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::dot_avx2::half;
use super::formats::QType;
use super::int16::avx2::{add, bytes32, f16s, floats_of, load8, Lanes};
use super::int16::{k_scales, Row};
use super::vnni::{codes64, load_i32, reduce_pairs, reduce_quads, PlaneRow};

/// Weight rows a pass.
pub const ROWS: usize = 4;
/// Elements per block of x.
const QK: usize = 32;

/// Whether the decode path takes rows of `t` four a pass: Q4_0 only. The units below take every
/// type `vnni::decodes` (tested bit for bit), but SmolLM2's products per step measured slower
/// four a pass for the others (Q4_1 file 0.79x, Q4_K_M file, mostly Q5_0: 0.66x; Q4_0 1.11x;
/// busy, thread CPU time; benches/RESULTS.md, "four weight rows a pass"): their extra codes and
/// scales for four rows exceed the registers.
pub fn takes(t: QType) -> bool {
    t == QType::Q4_0
}

/// Whether `rows_dots_vnni` can take rows of `t` (the types `vnni::decodes`).
#[cfg(test)]
pub fn can_take(t: QType) -> bool {
    super::int16::takes(t) && super::vnni::decodes(t)
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

/// `vnni::group32` for four weight rows (`b`: each one's block `blk0`) of the 32-element block
/// type of ggml code `T` (not Q8_0), blocks `blk0..blk0 + n` (`n` <= 8).
#[inline(always)]
unsafe fn group32<const T: u32>(
    b: [*const u8; ROWS],
    blk0: usize,
    n: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let bytes = bytes32(T);
    let mut z = [[_mm512_setzero_si512(); 4]; ROWS];
    for j in 0..4 {
        let first = 2 * j;
        if first >= n {
            break;
        }
        let two = first + 1 < n;
        let mut w = [_mm512_setzero_si512(); ROWS];
        for (w, b) in w.iter_mut().zip(b) {
            *w = codes64::<T>(b.add(first * bytes), two);
        }
        let d = dots(w, p, QK * (blk0 + first));
        for (z, d) in z.iter_mut().zip(d) {
            z[j] = d;
        }
    }
    // x's parts shared by the four rows
    let offset = match T {
        2 => Some(_mm256_slli_epi32::<3>(load_i32(p.sum32, blk0, n))),
        6 => Some(_mm256_slli_epi32::<4>(load_i32(p.sum32, blk0, n))),
        _ => None,
    };
    let dx = load8(x.d, blk0, n);
    let min = T == 3 || T == 7;
    let xs = if min {
        load8(x.s, blk0, n)
    } else {
        _mm256_setzero_ps()
    };
    for (r, (z, b)) in z.into_iter().zip(b).enumerate() {
        let mut s = reduce_pairs(z);
        if let Some(o) = offset {
            s = _mm256_sub_epi32(s, o);
        }
        let c = _mm256_mul_ps(f16s(b, bytes, 0, n), dx);
        let (mut acc, mut mins) = ([lanes.acc[r]], [lanes.mins[r]]);
        add([s], [c], &mut acc);
        if min {
            let mw = f16s(b, bytes, 2, n);
            mins[0] = _mm256_add_ps(mins[0], _mm256_mul_ps(mw, xs));
        }
        (lanes.acc[r], lanes.mins[r]) = (acc[0], mins[0]);
    }
}

/// Four rows of the 32-element block type of ggml code `T`, 8 blocks at a time.
#[inline(always)]
unsafe fn rows32<const T: u32>(
    rows: [*const u8; ROWS],
    k: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let (blocks, bytes) = (k / QK, bytes32(T));
    // whole groups with n = 8 known (the scales' gather unrolled, no branch), then the rest
    let mut blk = 0;
    while blk + 8 <= blocks {
        // blocks blk..blk + 8 of each row: inside it
        let b = rows.map(|r| r.add(blk * bytes));
        group32::<T>(b, blk, 8, x, p, lanes);
        blk += 8;
    }
    if blk < blocks {
        let b = rows.map(|r| r.add(blk * bytes));
        group32::<T>(b, blk, blocks - blk, x, p, lanes);
    }
}

/// Four Q4_K or (`FIVE`) Q5_K rows, a super-block (8 sub-blocks: 8 units) at a time.
#[inline(always)]
unsafe fn k_rows<const FIVE: bool>(
    rows: [*const u8; ROWS],
    k: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let bytes = if FIVE { 176 } else { 144 };
    let nibble = _mm512_set1_epi8(0xF);
    for sb in 0..k / 256 {
        // super-block sb of each row: inside it
        let b = rows.map(|r| r.add(sb * bytes));
        let mut z = [[_mm512_setzero_si512(); 4]; ROWS];
        for g in 0..4 {
            // sub-blocks 2g (low nibbles) and 2g + 1 (high nibbles) of 32 bytes
            let mut w = [_mm512_setzero_si512(); ROWS];
            for (w, b) in w.iter_mut().zip(b) {
                let qs = b.add(if FIVE { 48 } else { 16 });
                let v = _mm256_loadu_si256(qs.add(32 * g).cast());
                let both =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
                *w = _mm512_and_si512(both, nibble);
                if FIVE {
                    // bit i of each qh byte is sub-block i's bit 4
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16).cast()));
                    let sel = _mm512_inserti64x4::<1>(
                        _mm512_set1_epi8((1u8 << (2 * g)) as i8),
                        _mm256_set1_epi8((1u8 << (2 * g + 1)) as i8),
                    );
                    let set = _mm512_test_epi8_mask(qh, sel);
                    *w = _mm512_mask_add_epi8(*w, set, *w, _mm512_set1_epi8(16));
                }
            }
            let d = dots(w, p, 256 * sb + 64 * g);
            for (z, d) in z.iter_mut().zip(d) {
                z[g] = d;
            }
        }
        let blk0 = 8 * sb;
        let dx = _mm256_loadu_ps(x.d.as_ptr().add(blk0));
        let xs = _mm256_loadu_ps(x.s.as_ptr().add(blk0));
        for (r, (z, b)) in z.into_iter().zip(b).enumerate() {
            let s = reduce_pairs(z);
            // from here as `vnni::k_rows`
            let (scales, mins) = k_scales(std::slice::from_raw_parts(b.add(4), 12));
            let dl = _mm256_mul_ps(_mm256_set1_ps(half(b)), floats_of(scales));
            let mut acc = [lanes.acc[r]];
            add([s], [_mm256_mul_ps(dl, dx)], &mut acc);
            lanes.acc[r] = acc[0];
            let ml = _mm256_mul_ps(_mm256_set1_ps(half(b.add(2))), floats_of(mins));
            let ml = _mm256_xor_ps(ml, _mm256_set1_ps(-0.0));
            lanes.mins[r] = _mm256_add_ps(lanes.mins[r], _mm256_mul_ps(ml, xs));
        }
    }
}

/// Four Q6_K rows: per super-block and half, two vectors of 64 codes a row (`vnni::q6_k_rows`).
#[inline(always)]
unsafe fn q6_k_rows(
    rows: [*const u8; ROWS],
    k: usize,
    x: &Row<'_>,
    p: &PlaneRow<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let (nibble, bits45) = (_mm512_set1_epi8(0xF), _mm512_set1_epi8(0x30));
    let (by2, by4) = (0x0002_0002_0002_0002, 0x0004_0004_0004_0004);
    let left01 = _mm512_setr_epi64(by4, by4, by4, by4, by2, by2, by2, by2);
    let right23 = _mm512_setr_epi64(0, 0, 0, 0, by2, by2, by2, by2);
    let pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    for sb in 0..k / 256 {
        // super-block sb of each row: inside it
        let b = rows.map(|r| r.add(sb * 210));
        for h in 0..2 {
            let mut w01 = [_mm512_setzero_si512(); ROWS];
            let mut w23 = [_mm512_setzero_si512(); ROWS];
            for ((w01, w23), b) in w01.iter_mut().zip(&mut w23).zip(b) {
                let (ql, qh) = (b, b.add(128));
                let low = _mm512_loadu_si512(ql.add(64 * h).cast());
                let high = _mm512_broadcast_i64x4(_mm256_loadu_si256(qh.add(32 * h).cast()));
                *w01 = _mm512_or_si512(
                    _mm512_and_si512(low, nibble),
                    _mm512_and_si512(_mm512_sllv_epi16(high, left01), bits45),
                );
                *w23 = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(low), nibble),
                    _mm512_and_si512(_mm512_srlv_epi16(high, right23), bits45),
                );
            }
            let e = 256 * sb + 128 * h;
            let z01 = dots(w01, p, e);
            let z23 = dots(w23, p, e + 64);
            let blk0 = 8 * sb + 4 * h;
            let sums =
                _mm256_slli_epi32::<5>(_mm256_loadu_si256(p.sum16.as_ptr().add(2 * blk0).cast()));
            let v = _mm_loadu_ps(x.d.as_ptr().add(blk0));
            let dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), pairs);
            for (r, b) in b.into_iter().enumerate() {
                let s = _mm256_sub_epi32(reduce_quads(z01[r], z23[r]), sums);
                // from here as `vnni::q6_k_rows`
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    b.add(192 + 8 * h).cast(),
                )));
                let dl = _mm256_mul_ps(_mm256_set1_ps(half(b.add(208))), sc);
                let mut acc = [lanes.acc[r]];
                add([s], [_mm256_mul_ps(dl, dx)], &mut acc);
                lanes.acc[r] = acc[0];
            }
        }
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
        QType::Q4_0 => rows32::<2>(w, k, x, p, &mut lanes),
        QType::Q4_1 => rows32::<3>(w, k, x, p, &mut lanes),
        QType::Q5_0 => rows32::<6>(w, k, x, p, &mut lanes),
        QType::Q5_1 => rows32::<7>(w, k, x, p, &mut lanes),
        QType::Q4_K => k_rows::<false>(w, k, x, p, &mut lanes),
        QType::Q5_K => k_rows::<true>(w, k, x, p, &mut lanes),
        QType::Q6_K => q6_k_rows(w, k, x, p, &mut lanes),
        _ => unreachable!("{} is not taken four rows a pass", t.name()),
    }
    lanes.totals()
}
