//! `int16`'s AVX2 decode products four weight rows a pass, for one row of x and the 32-element
//! block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), at the AVX-512 level (32 registers; Q8_0's rows,
//! which stay on the AVX2 units there, `vnni::decodes`): x's codes of a block are loaded once
//! for the four rows, x's scales and sums once a group (`vnni4` does the same on VNNI). Each weight row keeps the integer sums and the
//! very f32 steps of `int16::row_dots_avx2::<1>` in the same order, so each result equals it
//! (and `int16::row_dot`) bit for bit.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::formats::QType;
use super::int16::avx2::{add, bytes32, f16s, finish, hadd, load8, weights32, Lanes};
use super::int16::{fold, Row};

/// Weight rows a pass.
pub const ROWS: usize = 4;
/// Elements per block of x.
const QK: usize = 32;

/// Whether `rows_dots_avx512` takes rows of `t`.
pub fn takes(t: QType) -> bool {
    matches!(
        t,
        QType::Q8_0 | QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1
    )
}

/// `int16::avx2::group32` for four weight rows (`b`: each one's block `blk0`) of the
/// 32-element block type of ggml code `T`, blocks `blk0..blk0 + n` (`n` <= 8).
#[inline(always)]
unsafe fn group32<const T: u32>(
    b: [*const u8; ROWS],
    blk0: usize,
    n: usize,
    x: &Row<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let bytes = bytes32(T);
    let mut g = [[_mm256_setzero_si256(); ROWS]; 2];
    for (q, g) in g.iter_mut().enumerate() {
        let mut h = [[_mm256_setzero_si256(); ROWS]; 2];
        for (p, h) in h.iter_mut().enumerate() {
            let j = 4 * q + 2 * p;
            let mut u = [[_mm256_setzero_si256(); ROWS]; 2];
            for (i, u) in u.iter_mut().enumerate() {
                if j + i < n {
                    // block blk0 + j + i of x: inside its row
                    let xp = x.q.as_ptr().add(QK * (blk0 + j + i));
                    let lo = _mm256_loadu_si256(xp.cast());
                    let hi = _mm256_loadu_si256(xp.add(16).cast());
                    for (u, b) in u.iter_mut().zip(b) {
                        let w = weights32::<T>(b.add((j + i) * bytes));
                        *u = _mm256_add_epi32(
                            _mm256_madd_epi16(w[0], lo),
                            _mm256_madd_epi16(w[1], hi),
                        );
                    }
                }
            }
            *h = hadd(u[0], u[1]);
        }
        *g = hadd(h[0], h[1]);
    }
    let s = finish(g[0], g[1]);
    let dx = load8(x.d, blk0, n);
    let mut c = [dx; ROWS];
    for (c, b) in c.iter_mut().zip(b) {
        *c = _mm256_mul_ps(f16s(b, bytes, 0, n), dx);
    }
    add(s, c, &mut lanes.acc);
    if T == 3 || T == 7 {
        let xs = load8(x.s, blk0, n);
        for (m, b) in lanes.mins.iter_mut().zip(b) {
            *m = _mm256_add_ps(*m, _mm256_mul_ps(f16s(b, bytes, 2, n), xs));
        }
    }
}

/// Four rows of the 32-element block type of ggml code `T`, 8 blocks at a time.
#[inline(always)]
unsafe fn rows32<const T: u32>(
    rows: [*const u8; ROWS],
    k: usize,
    x: &Row<'_>,
    lanes: &mut Lanes<ROWS>,
) {
    let (blocks, bytes) = (k / QK, bytes32(T));
    // whole groups with n = 8 known (the scales' gather unrolled, no branch), then the rest
    let mut blk = 0;
    while blk + 8 <= blocks {
        // blocks blk..blk + 8 of each row: inside it
        let b = rows.map(|r| r.add(blk * bytes));
        group32::<T>(b, blk, 8, x, lanes);
        blk += 8;
    }
    if blk < blocks {
        let b = rows.map(|r| r.add(blk * bytes));
        group32::<T>(b, blk, blocks - blk, x, lanes);
    }
}

/// `int16::row_dots_avx2::<1>` of each of the four weight rows `rows` (type `t`) with the row
/// of x `x`: the same bits, x read once for the four. Compiled with AVX-512's 32 vector
/// registers (the four rows' partial sums spill out of AVX2's 16: SmolLM2's Q8_0 output matrix
/// ran 1.35x slower so); the instructions are AVX2's (their EVEX forms), the same bits.
///
/// # Safety
/// The process runs at AVX-512 (`super::vnni()`); `takes(t)`; each of `rows` holds `k`
/// elements of `t` and x `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn rows_dots_avx512(
    t: QType,
    rows: [&[u8]; ROWS],
    k: usize,
    x: &Row<'_>,
) -> [f32; ROWS] {
    let mut lanes = Lanes {
        acc: [_mm256_setzero_ps(); ROWS],
        mins: [_mm256_setzero_ps(); ROWS],
    };
    let w = rows.map(<[u8]>::as_ptr);
    match t {
        QType::Q8_0 => rows32::<8>(w, k, x, &mut lanes),
        QType::Q4_0 => rows32::<2>(w, k, x, &mut lanes),
        QType::Q4_1 => rows32::<3>(w, k, x, &mut lanes),
        QType::Q5_0 => rows32::<6>(w, k, x, &mut lanes),
        QType::Q5_1 => rows32::<7>(w, k, x, &mut lanes),
        _ => unreachable!("{} is not taken four rows a pass", t.name()),
    }
    let mut out = [0.0; ROWS];
    for (r, o) in out.iter_mut().enumerate() {
        let (mut a, mut m) = ([0.0f32; 8], [0.0f32; 8]);
        _mm256_storeu_ps(a.as_mut_ptr(), lanes.acc[r]);
        _mm256_storeu_ps(m.as_mut_ptr(), lanes.mins[r]);
        *o = fold(a) + fold(m);
    }
    out
}
