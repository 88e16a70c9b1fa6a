//! bfloat16 expert products with `vdpbf16ps` (AVX-512 BF16): two bf16 products summed into each
//! f32 lane per instruction, on the experts' existing panels `[ceil(N / 16), K, 16]`.
//!
//! A panel's rows k and k + 1 are 32 contiguous bf16, one 512-bit load; one `vpermw` interleaves
//! them into the (k, k + 1) pairs `vdpbf16ps` takes, once per pair of rows for all of a tile's
//! token rows. x is taken as bf16 pairs: for a bfloat16 model the rows already are bf16 (the
//! gathered input and SwiGLU's bf16 output), so nothing is rounded that torch's bf16 path keeps;
//! the sums are f32, rounded once to bf16 per output (`vcvtneps2bf16`, round to nearest even;
//! like the instruction, it treats subnormal inputs as zero). A row's result does not depend on
//! the tile it runs in: every row adds the same pairs in the same order into its own lanes.
use std::ops::Range;

use crate::cpu::isa::{self, Extension};
use crate::cpu::{Bf16, Elem};

/// Output panels per tile (32 columns) and token rows per tile at most.
const TILE_PANELS: usize = 2;
const TILE_ROWS: usize = 8;
/// The panels' width (`linear::PANEL`).
const PANEL: usize = 16;

/// Whether this machine runs `Product::run` (asked of `isa`, the one owner of the check).
pub(crate) fn available() -> bool {
    isa::has(Extension::Avx512Bf16)
}

/// x's rows as bf16 pairs `[m, ceil(k / 2)]` (low half: the even element), an odd k's last
/// pair padded with zero.
pub(crate) fn pairs(x: &[f32], m: usize, k: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut out = vec![0u32; m * kp];
    for (row, dst) in x.chunks_exact(k).zip(out.chunks_exact_mut(kp)) {
        for (d, src) in dst.iter_mut().zip(row.chunks(2)) {
            let lo = Bf16::from_f32(src[0]).0 as u32;
            let hi = src.get(1).map_or(0, |&v| Bf16::from_f32(v).0) as u32;
            *d = lo | (hi << 16);
        }
    }
    out
}

/// One expert's product `out [m, n] = x [m, k] · W^T` over bf16 panels `w`.
pub(crate) struct Product<'a> {
    /// `[m, ceil(k / 2)]` (`pairs`)
    pub x: &'a [u32],
    /// `[ceil(n / 16), k, 16]` bf16 bits
    pub w: &'a [u16],
    pub out: *mut u16,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

// SAFETY: a product's runs write disjoint panel ranges of its own rows of `out` (`run`'s
// contract), and its caller holds `out`'s exclusive borrow until every run has returned.
unsafe impl Send for Product<'_> {}
unsafe impl Sync for Product<'_> {}

impl Product<'_> {
    /// The output columns of `panels`.
    ///
    /// # Safety
    /// `available()` must be true; `out` must point to `m * n` elements that only this
    /// product's runs over disjoint panel ranges write while they run.
    pub(crate) unsafe fn run(&self, panels: Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked `available()` (AVX-512 F/BW/VL and BF16).
        unsafe {
            avx512::run(self, panels)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = panels;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{Product, PANEL, TILE_PANELS, TILE_ROWS};

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub(super) unsafe fn run(p: &Product<'_>, panels: Range<usize>) {
        let mut panel = panels.start;
        while panel < panels.end {
            let np = (panels.end - panel).min(TILE_PANELS);
            let mut row = 0;
            while row < p.m {
                let left = p.m - row;
                // SAFETY (each call): rows row.., panels panel..panel + np exist in x, w, out.
                match (left, np) {
                    (8.., 2) => unsafe { tile::<8, 2>(p, row, panel) },
                    (8.., _) => unsafe { tile::<8, 1>(p, row, panel) },
                    (4.., 2) => unsafe { tile::<4, 2>(p, row, panel) },
                    (4.., _) => unsafe { tile::<4, 1>(p, row, panel) },
                    (2.., 2) => unsafe { tile::<2, 2>(p, row, panel) },
                    (2.., _) => unsafe { tile::<2, 1>(p, row, panel) },
                    (_, 2) => unsafe { tile::<1, 2>(p, row, panel) },
                    _ => unsafe { tile::<1, 1>(p, row, panel) },
                }
                row += match left {
                    8.. => TILE_ROWS,
                    4.. => 4,
                    2.. => 2,
                    _ => 1,
                };
            }
            panel += np;
        }
    }

    /// Rows `row..row + R` by panels `panel..panel + P`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn tile<const R: usize, const P: usize>(p: &Product<'_>, row: usize, panel: usize) {
        let (k, kp) = (p.k, p.k.div_ceil(2));
        // lane 2j <- row k's column j, lane 2j + 1 <- row k + 1's column j
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let w = |q: usize| p.w.as_ptr().add((panel + q) * k * PANEL);
        let x = p.x.as_ptr().add(row * kp);
        for i in 0..k / 2 {
            let mut wv = [_mm512_setzero_si512(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                let rows = _mm512_loadu_si512(w(q).add(2 * i * PANEL).cast());
                *v = _mm512_permutexvar_epi16(idx, rows);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_epi32(*x.add(r * kp + i) as i32);
                for q in 0..P {
                    acc[q] = _mm512_dpbf16_ps(
                        acc[q],
                        std::mem::transmute::<__m512i, __m512bh>(wv[q]),
                        std::mem::transmute::<__m512i, __m512bh>(xv),
                    );
                }
            }
        }
        if k % 2 == 1 {
            // the last row alone, paired with zeros (x's pair is padded with zero too)
            let i = k / 2;
            let mut wv = [_mm512_setzero_si512(); P];
            for (q, v) in wv.iter_mut().enumerate() {
                let last = _mm256_loadu_si256(w(q).add(2 * i * PANEL).cast());
                *v = _mm512_permutexvar_epi16(idx, _mm512_zextsi256_si512(last));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_epi32(*x.add(r * kp + i) as i32);
                for q in 0..P {
                    acc[q] = _mm512_dpbf16_ps(
                        acc[q],
                        std::mem::transmute::<__m512i, __m512bh>(wv[q]),
                        std::mem::transmute::<__m512i, __m512bh>(xv),
                    );
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (q, acc) in acc.iter().enumerate() {
                let col = (panel + q) * PANEL;
                let cols = (p.n - col).min(PANEL);
                let mask: __mmask16 = if cols == PANEL {
                    0xffff
                } else {
                    (1u16 << cols) - 1
                };
                let bits = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(*acc));
                _mm256_mask_storeu_epi16(p.out.add((row + r) * p.n + col).cast(), mask, bits);
            }
        }
    }
}
