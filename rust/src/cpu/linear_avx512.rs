//! The linear kernel's register tiles at the AVX-512 level (`linear.rs` chooses them where
//! `isa::level()` is AVX-512 or above). A panel's 16 output columns are one 512-bit register,
//! so a tile row is one accumulator instead of AVX2's two, and the 32 registers hold taller
//! tiles: up to `DIRECT_MAX_ROWS` rows of x read in place (a decode step of up to 16 rows reads
//! each weight once), or two packed tiles of `TILE_ROWS` rows at a time (prefill: 12
//! independent FMA chains cover the FMA units' latency).
//!
//! Each lane is still one output element's FMA chain over `k` in order, starting from the sums
//! given, exactly as in the AVX2 and portable tiles: float32 results are bit-identical across
//! the levels (only the width of the registers and the tile heights differ).

use std::arch::x86_64::*;

use super::elem::Elem;
use super::linear::{Pairs, DIRECT_MAX_ROWS, PANEL, TILE_ROWS};

/// How many steps (weight rows of a panel, one 64-byte line each in f32) ahead a tile that
/// reads its weights from memory prefetches them: a step of a 12-row tile is ~6 cycles of FMAs,
/// a DRAM miss a few hundred.
const PREFETCH_STEPS: usize = 64;

/// Prefetches the weight line at `at`: a direct tile (x read in place: every row of x in one
/// tile, so each weight line is read once) marks it non-temporal, which spares the caches the
/// stream (float32 SmolLM2 decode 1.07x, at the host's streaming floor); a packed tile's slice
/// is read again by the next tiles of x, so it stays an ordinary prefetch.
#[inline(always)]
unsafe fn prefetch_weights<const PACKED: bool>(at: *const i8) {
    if PACKED {
        _mm_prefetch::<_MM_HINT_T0>(at);
    } else {
        _mm_prefetch::<_MM_HINT_NTA>(at);
    }
}

// the row counts `tile_direct` and `tile_packed` spell out
const _: () = assert!(DIRECT_MAX_ROWS == 16 && TILE_ROWS == 6 && PANEL == 16);

/// Sixteen elements at `p` as f32 lanes: a plain load for f32, for bf16 sixteen 16-bit loads
/// zero-extended and shifted into the high half of each lane (exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[inline]
pub(crate) unsafe fn load16<T: Elem>(p: *const T) -> __m512 {
    if T::IS_BF16 {
        let halves = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

/// Where step `i` of row `r` of an `R`-row tile's x is: rows of `k` in place (`xa`); packed,
/// one tile's `[depth, R]` (`xa`, R <= TILE_ROWS) or two tiles, a full one (`xa`, `[depth,
/// TILE_ROWS]`) and the next (`xb`, `[depth, R - TILE_ROWS]`).
#[inline(always)]
unsafe fn x_ptr<const R: usize, const PACKED: bool>(
    xa: *const f32,
    xb: *const f32,
    r: usize,
    i: usize,
    k: usize,
) -> *const f32 {
    if !PACKED {
        xa.add(r * k + i)
    } else if R <= TILE_ROWS {
        xa.add(i * R + r)
    } else if r < TILE_ROWS {
        xa.add(i * TILE_ROWS + r)
    } else {
        xb.add(i * (R - TILE_ROWS) + r - TILE_ROWS)
    }
}

/// `acc[r][j] += x(r, i) * w[i * PANEL + j]` for `i` in `0..depth` in order, for the tile's `R`
/// rows (`x_ptr` says where x(r, i) is).
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL (the ISA level); `w` must hold `depth * PANEL` elements,
/// `acc` at least `R` rows, and x every element `x_ptr` names for `r < R`, `i < depth`.
/// With `PF`, each step also prefetches the weight row `PREFETCH_STEPS` steps ahead (past the
/// slice's end that is the next slice or panel: the panels are one contiguous array).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[inline]
unsafe fn tile<T: Elem, const R: usize, const PACKED: bool, const PF: bool>(
    xa: *const f32,
    xb: *const f32,
    w: *const T,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    debug_assert!(acc.len() >= R);
    let mut sums = [_mm512_setzero_ps(); R];
    for (s, src) in sums.iter_mut().zip(acc.iter()) {
        *s = _mm512_loadu_ps(src.as_ptr());
    }
    for i in 0..depth {
        if PF {
            // a hint only: an address past the weights' end does not fault
            let ahead = w.wrapping_add((i + PREFETCH_STEPS) * PANEL);
            prefetch_weights::<PACKED>(ahead.cast::<i8>());
        }
        let wv = load16(w.add(i * PANEL));
        for (r, s) in sums.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*x_ptr::<R, PACKED>(xa, xb, r, i, k));
            *s = _mm512_fmadd_ps(a, wv, *s);
        }
    }
    for (dst, s) in acc.iter_mut().zip(&sums) {
        _mm512_storeu_ps(dst.as_mut_ptr(), *s);
    }
}

/// `tile` for `rows` rows of x read in place (`[rows, k]` at `x`), 1..=16.
///
/// # Safety
/// As `tile`: the CPU has the level; `x` holds `rows * k` floats, `w` `depth * PANEL`
/// elements, `acc` `rows` rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[inline]
pub(super) unsafe fn tile_direct<T: Elem>(
    rows: usize,
    x: *const f32,
    w: *const T,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => tile::<T, $r, false, true>(x, x, w, k, k, acc),)*
                _ => unreachable!("a direct tile has 1..=16 rows, not {rows}"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// `tile` for `rows` rows of packed x (1..=2 * TILE_ROWS): one tile at `xa` (`rows <=
/// TILE_ROWS`) or a full tile at `xa` and the next one's `rows - TILE_ROWS` rows at `xb`;
/// `prefetch` for the first tiles over a weight slice (the others find it in L1).
///
/// # Safety
/// As `tile`: the CPU has the level; `xa` (and `xb`) hold their tiles' `depth` steps, `w`
/// `depth * PANEL` elements, `acc` `rows` rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_packed<T: Elem>(
    prefetch: bool,
    rows: usize,
    xa: *const f32,
    xb: *const f32,
    w: *const T,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => if prefetch {
                    tile::<T, $r, true, true>(xa, xb, w, depth, k, acc)
                } else {
                    tile::<T, $r, true, false>(xa, xb, w, depth, k, acc)
                },)*
                _ => unreachable!("a packed tile pair has 1..=12 rows, not {rows}"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11 12)
}

/// Each output column's weights of two k steps side by side: `vpermw`'s index that turns a
/// panel's rows `2i` and `2i + 1` (32 bf16, row after row) into 16 pairs `(w[2i][j],
/// w[2i + 1][j])`, the operand order `vdpbf16ps` multiplies x's pairs with.
static PAIR_COLUMNS: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut j = 0;
    while j < 16 {
        idx[2 * j] = j as u16;
        idx[2 * j + 1] = 16 + j as u16;
        j += 1;
    }
    idx
};

/// Rows `x [m, k]` (f32 holding bf16 values) as bf16 pairs: `[m, ceil(k / 2)]` 32-bit lanes
/// (as f32 bits), steps `2i` (low half) and `2i + 1` (high half; zero past an odd k). The
/// kernels write this layout with `bf16_pairs_into` (direct tiles) and `linear::pack_pairs`
/// (packed tiles); this allocating form is the tests'.
#[cfg(test)]
pub(super) fn bf16_pairs(x: &[f32], k: usize) -> Vec<f32> {
    let mut pairs = Vec::new();
    bf16_pairs_into(x, k, &mut pairs);
    pairs
}

/// `bf16_pairs` into `pairs` (its contents replaced, its capacity kept).
pub(super) fn bf16_pairs_into(x: &[f32], k: usize, pairs: &mut Vec<f32>) {
    pairs.clear();
    pairs.reserve(x.len() / k * k.div_ceil(2));
    for row in x.chunks_exact(k) {
        pairs.extend(
            row.chunks(2)
                .map(|s| bf16_pair(s[0], s.get(1).copied().unwrap_or(0.0))),
        );
    }
}

/// One `bf16_pairs` lane: steps `a` (low half) and `b` (high half) rounded to bf16.
#[inline(always)]
pub(super) fn bf16_pair(a: f32, b: f32) -> f32 {
    use super::elem::Bf16;
    let half = |v: f32| Bf16::from_f32(v).0 as u32;
    f32::from_bits(half(a) | (half(b) << 16))
}

/// `tile` over bf16 weights with `vdpbf16ps`: each lane adds the products of the pair `i` of
/// steps, `x(r, 2i) w[2i][j]` and `x(r, 2i + 1) w[2i + 1][j]`, for the pairs of `0..depth`
/// steps in order (an odd depth's last pair is `(x, 0)` by `(w, 0)`). A pair of weight rows is
/// 32 bf16 at `w + i * pairs.stride`, row after row (a `vpermw` pairs them) or, in a group of
/// panels, already `paired` (`linear::Pairs`). x is `bf16_pairs` (one
/// 32-bit lane a pair; `x_ptr` with `k` the pairs per row of x), so it must hold bf16 values:
/// the products are then exact, and only the sums differ from the widening tiles' (two adds a
/// pair in the instruction's order, subnormal inputs and outputs flushed to zero).
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL and BF16 (`isa::has(Extension::Avx512Bf16)`); `w` holds
/// `linear::pairs_extent(depth, pairs.stride)` bf16, `acc` at least `R` rows, x the pairs
/// `x_ptr` names for `r < R`, `i < ceil(depth / 2)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
unsafe fn tile_pairs<T: Elem, const R: usize, const PACKED: bool>(
    xa: *const f32,
    xb: *const f32,
    w: *const T,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    debug_assert!(T::IS_BF16 && acc.len() >= R);
    let idx = _mm512_loadu_si512(PAIR_COLUMNS.as_ptr() as *const __m512i);
    let mut sums = [_mm512_setzero_ps(); R];
    for (s, src) in sums.iter_mut().zip(acc.iter()) {
        *s = _mm512_loadu_ps(src.as_ptr());
    }
    let w = w as *const u16;
    let step = |sums: &mut [__m512; R], i: usize, rows: __m512i| {
        let wv = if pairs.paired {
            rows
        } else {
            _mm512_permutexvar_epi16(idx, rows)
        };
        let wv = std::mem::transmute::<__m512i, __m512bh>(wv);
        for (r, s) in sums.iter_mut().enumerate() {
            let x = *(x_ptr::<R, PACKED>(xa, xb, r, i, k) as *const i32);
            let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(x));
            *s = _mm512_dpbf16_ps(*s, xv, wv);
        }
    };
    for i in 0..depth / 2 {
        step(
            &mut sums,
            i,
            _mm512_loadu_si512(w.add(i * pairs.stride) as *const __m512i),
        );
    }
    if depth % 2 == 1 {
        let last = _mm256_loadu_si256(w.add(depth / 2 * pairs.stride) as *const __m256i);
        step(&mut sums, depth / 2, _mm512_zextsi256_si512(last));
    }
    for (dst, s) in acc.iter_mut().zip(&sums) {
        _mm512_storeu_ps(dst.as_mut_ptr(), *s);
    }
}

/// `tile_direct` with `tile_pairs` (x: `bf16_pairs` rows of `k` pairs; `depth` weight steps,
/// their pairs lying as `pairs` says).
///
/// # Safety
/// As `tile_pairs`, with x holding `rows * k` pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
pub(super) unsafe fn tile_pairs_direct<T: Elem>(
    rows: usize,
    x: *const f32,
    w: *const T,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => tile_pairs::<T, $r, false>(x, x, w, pairs, depth, k, acc),)*
                _ => unreachable!("a direct tile has 1..=16 rows, not {rows}"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// `tile_packed` with `tile_pairs` (x: packed tiles of `bf16_pairs`; the weights' pairs lying
/// as `pairs` says).
///
/// # Safety
/// As `tile_pairs` and `tile_packed`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_pairs_packed<T: Elem>(
    rows: usize,
    xa: *const f32,
    xb: *const f32,
    w: *const T,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => tile_pairs::<T, $r, true>(xa, xb, w, pairs, depth, k, acc),)*
                _ => unreachable!("a packed tile pair has 1..=12 rows, not {rows}"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11 12)
}

/// Panels a wide direct tile (`tile_pairs_wide`) runs side by side at `rows` rows of x: 4 up to
/// 6 rows, 2 up to 12 (at most 24 accumulators), else 1 (`tile_pairs_direct`).
pub(super) fn wide_panels(rows: usize) -> usize {
    match rows {
        0..=6 => 4,
        7..=12 => 2,
        _ => 1,
    }
}

/// `tile_pairs` over `G` adjacent panels at once (`w`: the first's pairs of weight rows, lying
/// as `pairs` says; the next panel's `stride` elements on), for `R` rows of x (in place or
/// packed: `x_ptr`): each step's pair of x is broadcast once for the `G` panels, and `G * R`
/// independent sums cover `vdpbf16ps`'s latency where one panel's `R` rows (a few rows: an
/// expert's tokens at decode) leave it waiting. Each weight stream is prefetched
/// `PREFETCH_STEPS / 2` pairs ahead: plain panels are `G` streams, a group of panels
/// (`linear::Ctx::panel_at`) read by a tile as wide as the group is one. Every lane is the
/// same chain of pairs as `tile_pairs`'s, so the sums are the same bits. `acc[g]` points to
/// panel `g`'s `R` rows of sums (continued in place).
///
/// # Safety
/// As `tile_pairs` (x: the pairs `x_ptr` names), with `w` holding `(G - 1) * stride +
/// linear::pairs_extent(depth, pairs.stride)` bf16 and each `acc[g]` `R` rows that nothing
/// else accesses during the call.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_pairs_wide<T: Elem, const R: usize, const G: usize, const PACKED: bool>(
    xa: *const f32,
    xb: *const f32,
    w: *const T,
    stride: usize,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: [*mut [f32; PANEL]; G],
) {
    debug_assert!(T::IS_BF16);
    let idx = _mm512_loadu_si512(PAIR_COLUMNS.as_ptr() as *const __m512i);
    let mut sums = [[_mm512_setzero_ps(); R]; G];
    for (panel, rows) in sums.iter_mut().zip(acc) {
        for (r, s) in panel.iter_mut().enumerate() {
            *s = _mm512_loadu_ps(rows.add(r).cast::<f32>());
        }
    }
    let w = w as *const u16;
    let step = |sums: &mut [[__m512; R]; G], i: usize, rows: [__m512i; G]| {
        let mut wv = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); G];
        for (v, r) in wv.iter_mut().zip(rows) {
            let r = if pairs.paired {
                r
            } else {
                _mm512_permutexvar_epi16(idx, r)
            };
            *v = std::mem::transmute::<__m512i, __m512bh>(r);
        }
        for r in 0..R {
            let xr = *(x_ptr::<R, PACKED>(xa, xb, r, i, k) as *const i32);
            let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(xr));
            for (panel, v) in sums.iter_mut().zip(&wv) {
                panel[r] = _mm512_dpbf16_ps(panel[r], xv, *v);
            }
        }
    };
    for i in 0..depth / 2 {
        let mut rows = [_mm512_setzero_si512(); G];
        for (g, r) in rows.iter_mut().enumerate() {
            let at = w.add(g * stride + i * pairs.stride);
            // a hint only: an address past the weights' end does not fault
            let ahead = at.wrapping_add(PREFETCH_STEPS / 2 * pairs.stride);
            prefetch_weights::<PACKED>(ahead.cast::<i8>());
            *r = _mm512_loadu_si512(at as *const __m512i);
        }
        step(&mut sums, i, rows);
    }
    if depth % 2 == 1 {
        let mut rows = [_mm512_setzero_si512(); G];
        for (g, r) in rows.iter_mut().enumerate() {
            let last =
                _mm256_loadu_si256(w.add(g * stride + depth / 2 * pairs.stride) as *const __m256i);
            *r = _mm512_zextsi256_si512(last);
        }
        step(&mut sums, depth / 2, rows);
    }
    for (panel, rows) in sums.iter().zip(acc) {
        for (r, s) in panel.iter().enumerate() {
            _mm512_storeu_ps(rows.add(r).cast::<f32>(), *s);
        }
    }
}

/// `tile_pairs_wide` for `rows` rows of x in place (1..=12) over `wide_panels(rows)` panels
/// (`stride` elements apart, their pairs of weight rows lying as `pairs` says).
///
/// # Safety
/// As `tile_pairs_wide`, with `G = wide_panels(rows)` and `acc` holding `G * rows` rows (panel
/// `g`'s from row `g * rows`; asserted).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_pairs_wide_direct<T: Elem>(
    rows: usize,
    x: *const f32,
    w: *const T,
    stride: usize,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: &mut [[f32; PANEL]],
) {
    let g = wide_panels(rows);
    assert!(acc.len() >= g * rows);
    let at = acc.as_mut_ptr();
    macro_rules! rows {
        ($g:literal: $($r:literal)*) => {
            match rows {
                $($r => {
                    let acc = std::array::from_fn::<_, $g, _>(|g| at.add(g * $r));
                    return tile_pairs_wide::<T, $r, $g, false>(x, x, w, stride, pairs, depth, k, acc);
                })*
                _ => {}
            }
        };
    }
    rows!(4: 1 2 3 4 5 6);
    rows!(2: 7 8 9 10 11 12);
    unreachable!("a wide direct tile has 1..=12 rows, not {rows}")
}

/// `tile_pairs_wide` over two panels' slices (`stride` elements apart, pairs of weight rows
/// lying as `pairs` says) for `rows` rows of
/// packed x (1..=2 * TILE_ROWS: one tile at `xa`, or a full one at `xa` and the next one's
/// rows at `xb`), the blocked path's tiles: each pair of x read once for both panels, up to 24
/// independent sums, continuing `acc_a` (the first panel's rows) and `acc_b` (the second's).
///
/// # Safety
/// As `tile_pairs_wide` and `tile_pairs_packed`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_pairs_wide_packed<T: Elem>(
    rows: usize,
    xa: *const f32,
    xb: *const f32,
    w: *const T,
    stride: usize,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc_a: &mut [[f32; PANEL]],
    acc_b: &mut [[f32; PANEL]],
) {
    assert!(acc_a.len() >= rows && acc_b.len() >= rows);
    let acc = [acc_a.as_mut_ptr(), acc_b.as_mut_ptr()];
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => tile_pairs_wide::<T, $r, 2, true>(xa, xb, w, stride, pairs, depth, k, acc),)*
                _ => unreachable!("a packed tile pair has 1..=12 rows, not {rows}"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11 12)
}

/// `tile_pairs_wide` over a whole group of `linear::PANEL_GROUP` grouped panels (`stride`
/// elements apart, pairs of weight rows lying as `pairs` says) for one packed tile of `rows`
/// rows (1..=TILE_ROWS) at `xa`: the blocked path's tile over grouped panels, each K slice of the
/// group one run of memory; continues `acc[g]` (panel `g`'s rows).
///
/// # Safety
/// As `tile_pairs_wide` with `G = 4` and `tile_pairs_packed` (x: one packed tile).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_pairs_group_packed<T: Elem>(
    rows: usize,
    xa: *const f32,
    w: *const T,
    stride: usize,
    pairs: Pairs,
    depth: usize,
    k: usize,
    acc: [*mut [f32; PANEL]; 4],
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match rows {
                $($r => tile_pairs_wide::<T, $r, 4, true>(xa, xa, w, stride, pairs, depth, k, acc),)*
                _ => unreachable!("a packed tile has 1..=6 rows, not {rows}"),
            }
        };
    }
    rows!(1 2 3 4 5 6)
}
