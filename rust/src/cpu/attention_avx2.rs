//! AVX2 + FMA inner loops of the paged attention kernel (`attention`), for head sizes that are a
//! multiple of 8. Every function here is `unsafe`: callers have checked the CPU for avx2 and fma
//! and pass pointers valid for the lengths described.
//!
//! Two shapes of the scores tile `S = Q K^T` (scores already in log2 units: q is pre-scaled by
//! `scale * log2(e)`, so the softmax uses `exp2`):
//! - rows in lanes (`qk_rows_in_lanes`, many query rows per kv head: prefill): `S^T[key][row]`,
//!   a register-blocked GEMM of a few keys (broadcast) by a few 8-row vectors of `Q^T`, no
//!   horizontal sums;
//! - keys in lanes (`qk_keys_in_lanes`, a few rows: decode): eight dot products at once, their
//!   eight partial-sum vectors folded into one vector of eight scores.
//!
//! `pv` accumulates `P V` into the output rows register-blocked (a few rows by 32 columns held
//! in registers across the whole key tile), for either layout of `P`.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::kv_quant::KvElem;

// 2^f on |f| <= 1/2: Taylor coefficients (ln 2)^k / k!, k = 7..0 (truncation error < 1e-8
// relative: below half an ulp of f32; the Horner rounding adds about one ulp)
pub(crate) const EXP2_C: [f32; 8] = [
    1.525_273_4e-5,
    1.540_353e-4,
    1.333_355_8e-3,
    9.618_129e-3,
    5.550_411e-2,
    2.402_265e-1,
    6.931_472e-1,
    1.0,
];

/// `2^x` lane by lane, to about 2 ulp; results below 2^-126 (and `x = -inf`) are exactly 0,
/// `x` above 127 gives 2^127.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp2(x: __m256) -> __m256 {
    let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-126.0));
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-126.0)),
        _mm256_set1_ps(127.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm256_sub_ps(x, n);
    let mut p = _mm256_set1_ps(EXP2_C[0]);
    for c in &EXP2_C[1..] {
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(*c));
    }
    // 2^n from the exponent bits: n + 127 in 1..=254, a normal number
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)))
}

#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)))
}

#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn hmax(v: __m256) -> f32 {
    let quad = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_max_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_max_ss(pair, _mm_shuffle_ps::<1>(pair, pair)))
}

/// `s[j * rp + r] = sum_x keys[j][x] * qt[x * rp + r]` for keys `j < n` and rows `r < rp`
/// (`rp` a multiple of 8): `qt` is `Q^T`, `[d][rp]`, `keys[j]` points at key j's `d` floats.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn qk_rows_in_lanes(
    qt: *const f32,
    rp: usize,
    keys: &[*const f32],
    d: usize,
    s: *mut f32,
) {
    let vecs = rp / 8;
    let mut v0 = 0;
    while v0 < vecs {
        let rv = (vecs - v0).min(4);
        let mut j = 0;
        while j < keys.len() {
            let kb = (keys.len() - j).min(3);
            let (qt, s, keys) = (qt.add(v0 * 8), s.add(j * rp + v0 * 8), &keys[j..j + kb]);
            match (kb, rv) {
                (3, 4) => qk_block::<3, 4>(qt, rp, keys, d, s),
                (3, 3) => qk_block::<3, 3>(qt, rp, keys, d, s),
                (3, 2) => qk_block::<3, 2>(qt, rp, keys, d, s),
                (3, _) => qk_block::<3, 1>(qt, rp, keys, d, s),
                (2, 4) => qk_block::<2, 4>(qt, rp, keys, d, s),
                (2, 3) => qk_block::<2, 3>(qt, rp, keys, d, s),
                (2, 2) => qk_block::<2, 2>(qt, rp, keys, d, s),
                (2, _) => qk_block::<2, 1>(qt, rp, keys, d, s),
                (_, 4) => qk_block::<1, 4>(qt, rp, keys, d, s),
                (_, 3) => qk_block::<1, 3>(qt, rp, keys, d, s),
                (_, 2) => qk_block::<1, 2>(qt, rp, keys, d, s),
                (_, _) => qk_block::<1, 1>(qt, rp, keys, d, s),
            }
            j += kb;
        }
        v0 += rv;
    }
}

/// `KB` keys by `RV` row vectors of the scores, `KB * RV` accumulators in registers.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::needless_range_loop)] // a register block's indices, unrolled (const bounds)
unsafe fn qk_block<const KB: usize, const RV: usize>(
    qt: *const f32,
    rp: usize,
    keys: &[*const f32],
    d: usize,
    s: *mut f32,
) {
    let mut acc = [[_mm256_setzero_ps(); RV]; KB];
    let mut k = [std::ptr::null::<f32>(); KB];
    k.copy_from_slice(&keys[..KB]);
    for x in 0..d {
        let row = qt.add(x * rp);
        let mut q = [_mm256_setzero_ps(); RV];
        for (v, q) in q.iter_mut().enumerate() {
            *q = _mm256_loadu_ps(row.add(v * 8));
        }
        for b in 0..KB {
            let key = _mm256_broadcast_ss(&*k[b].add(x));
            for v in 0..RV {
                acc[b][v] = _mm256_fmadd_ps(key, q[v], acc[b][v]);
            }
        }
    }
    for b in 0..KB {
        for v in 0..RV {
            _mm256_storeu_ps(s.add(b * rp + v * 8), acc[b][v]);
        }
    }
}

/// The eight scores `q . keys[j]`, `j < 8`, as one vector (`d` a multiple of 8; `q` f32;
/// quantized keys: each times its row's scale).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn qk_keys_in_lanes<C: KvElem>(
    q: *const f32,
    keys: &[*const C; 8],
    d: usize,
) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut x = 0;
    while x < d {
        let qv = _mm256_loadu_ps(q.add(x));
        for (a, k) in acc.iter_mut().zip(keys) {
            *a = _mm256_fmadd_ps(qv, C::load8(k.add(x)), *a);
        }
        x += 8;
    }
    // fold: after two rounds of pairwise horizontal adds, lane l of the low half holds the low
    // half's sum of key l % 4 (keys 0-3 in h01_23, 4-7 in h45_67), the high half the high's
    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let low = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
    let high = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
    let scores = _mm256_add_ps(low, high);
    if C::EXTRA == 0 {
        return scores;
    }
    let factors: [f32; 8] = std::array::from_fn(|l| C::factor(keys[l], d));
    _mm256_mul_ps(scores, _mm256_loadu_ps(factors.as_ptr()))
}

/// `qk_keys_in_lanes` for `R` rows at once (the rows of a GQA group: the same keys), each key
/// vector widened once for all of them, not once per row; four keys at a time so that the
/// `R * 4` sums, the `R` query vectors and the key stay in registers. The same sums in the same
/// order as `qk_keys_in_lanes`: bit for bit its scores.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn qk_keys_in_lanes_rows<C: KvElem, const R: usize>(
    q: [*const f32; R],
    keys: &[*const C; 8],
    d: usize,
) -> [__m256; R] {
    // per row, lanes: [sums of keys 0-3 over the low half of x, ... over the high half], then
    // the same for keys 4-7 (the fold of `qk_keys_in_lanes` before its cross-half add)
    let mut halves = [[_mm256_setzero_ps(); 2]; R];
    for (half, four) in keys.chunks_exact(4).enumerate() {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let mut x = 0;
        while x < d {
            let qv: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(q[r].add(x)));
            for (l, k) in four.iter().enumerate() {
                let kv = C::load8(k.add(x));
                for r in 0..R {
                    acc[r][l] = _mm256_fmadd_ps(qv[r], kv, acc[r][l]);
                }
            }
            x += 8;
        }
        for r in 0..R {
            let h01 = _mm256_hadd_ps(acc[r][0], acc[r][1]);
            let h23 = _mm256_hadd_ps(acc[r][2], acc[r][3]);
            halves[r][half] = _mm256_hadd_ps(h01, h23);
        }
    }
    let factors: [f32; 8] = std::array::from_fn(|l| C::factor(keys[l], d));
    let factors = _mm256_loadu_ps(factors.as_ptr());
    std::array::from_fn(|r| {
        let [h0123, h4567] = halves[r];
        let low = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
        let high = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
        let scores = _mm256_add_ps(low, high);
        if C::EXTRA == 0 {
            scores
        } else {
            _mm256_mul_ps(scores, factors)
        }
    })
}

/// Quantized values: `p[r * p_row + j * p_key] *= factor(values[j]) * lift` for rows `r < rows`
/// (after the softmax took its sums), so that `pv` accumulates the dequantized values (`lift`:
/// 1, or the power of two the AVX-512 `pv`'s lifted loads leave out).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn scale_by_values<C: KvElem>(
    p: *mut f32,
    p_row: usize,
    p_key: usize,
    rows: usize,
    values: &[*const C],
    d: usize,
    lift: f32,
) {
    for (j, &value) in values.iter().enumerate() {
        let factor = C::factor(value, d) * lift;
        if p_row == 1 {
            // rows in lanes: a contiguous run of `rows` (a multiple of 8)
            let (run, f) = (p.add(j * p_key), _mm256_set1_ps(factor));
            for r in (0..rows).step_by(8) {
                _mm256_storeu_ps(run.add(r), _mm256_mul_ps(_mm256_loadu_ps(run.add(r)), f));
            }
        } else {
            for r in 0..rows {
                *p.add(r * p_row + j * p_key) *= factor;
            }
        }
    }
}

/// Online-softmax step of a rows-in-lanes scores tile `s[j * rp + r]` (`j < n`, log2 units):
/// each row's running max `max[r]` moves to the tile's, the scores become `2^(s - max)` in
/// place, `sum[r]` is rescaled and grows by them, and `corr[r]` gets the factor the row's
/// output sums must be rescaled by. A row with no visible key yet (max -inf) keeps zeros.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn softmax_rows_in_lanes(
    s: *mut f32,
    rp: usize,
    n: usize,
    max: &mut [f32],
    sum: &mut [f32],
    corr: &mut [f32],
) {
    for v in (0..rp).step_by(8) {
        let mut tile_max = _mm256_set1_ps(f32::NEG_INFINITY);
        for j in 0..n {
            tile_max = _mm256_max_ps(tile_max, _mm256_loadu_ps(s.add(j * rp + v)));
        }
        let old = _mm256_loadu_ps(max.as_ptr().add(v));
        let new = _mm256_max_ps(old, tile_max);
        let base = new_base(new);
        let mut total = _mm256_setzero_ps();
        for j in 0..n {
            let at = s.add(j * rp + v);
            let p = exp2(_mm256_sub_ps(_mm256_loadu_ps(at), base));
            _mm256_storeu_ps(at, p);
            total = _mm256_add_ps(total, p);
        }
        let c = exp2(_mm256_sub_ps(old, base));
        let running = _mm256_loadu_ps(sum.as_ptr().add(v));
        _mm256_storeu_ps(sum.as_mut_ptr().add(v), _mm256_fmadd_ps(running, c, total));
        _mm256_storeu_ps(max.as_mut_ptr().add(v), new);
        _mm256_storeu_ps(corr.as_mut_ptr().add(v), c);
    }
}

/// The same for one row whose `n` scores (`n` a multiple of 8) lie contiguous at `s`.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn softmax_row(
    s: *mut f32,
    n: usize,
    max: &mut f32,
    sum: &mut f32,
    corr: &mut f32,
) {
    let mut tile_max = _mm256_set1_ps(f32::NEG_INFINITY);
    for j in (0..n).step_by(8) {
        tile_max = _mm256_max_ps(tile_max, _mm256_loadu_ps(s.add(j)));
    }
    let old = _mm256_set1_ps(*max);
    let new = _mm256_max_ps(old, _mm256_set1_ps(hmax(tile_max)));
    let base = new_base(new);
    let mut total = _mm256_setzero_ps();
    for j in (0..n).step_by(8) {
        let p = exp2(_mm256_sub_ps(_mm256_loadu_ps(s.add(j)), base));
        _mm256_storeu_ps(s.add(j), p);
        total = _mm256_add_ps(total, p);
    }
    let c = _mm256_cvtss_f32(exp2(_mm256_sub_ps(old, base)));
    *sum = sum.mul_add(c, hsum(total));
    *max = _mm256_cvtss_f32(new);
    *corr = c;
}

/// What the scores are measured from: the running max, or 0 while it is -inf (no key seen),
/// so that -inf - -inf never makes a NaN.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn new_base(max: __m256) -> __m256 {
    let none = _mm256_cmp_ps::<_CMP_EQ_OQ>(max, _mm256_set1_ps(f32::NEG_INFINITY));
    _mm256_andnot_ps(none, max)
}

/// `out[row_at[r] ..][x] = out[..][x] * corr[r] + sum_j p[r * p_row + j * p_key] * values[j][x]`
/// for rows `r < row_at.len()`, keys `j < values.len()`, columns `x < d` (a multiple of 8).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pv<T: KvElem>(
    out: *mut f32,
    row_at: &[usize],
    corr: &[f32],
    p: *const f32,
    p_row: usize,
    p_key: usize,
    values: &[*const T],
    d: usize,
) {
    let mut r = 0;
    while r < row_at.len() {
        let rb = (row_at.len() - r).min(3);
        let mut x = 0;
        while x < d {
            let wide = d - x >= 32;
            let args = (out, &row_at[r..r + rb], &corr[r..r + rb], p.add(r * p_row));
            match (rb, wide) {
                (3, true) => pv_block::<3, 4, T>(args, p_row, p_key, values, x),
                (2, true) => pv_block::<2, 4, T>(args, p_row, p_key, values, x),
                (_, true) => pv_block::<1, 4, T>(args, p_row, p_key, values, x),
                (3, false) => pv_block::<3, 1, T>(args, p_row, p_key, values, x),
                (2, false) => pv_block::<2, 1, T>(args, p_row, p_key, values, x),
                (_, false) => pv_block::<1, 1, T>(args, p_row, p_key, values, x),
            }
            x += if wide { 32 } else { 8 };
        }
        r += rb;
    }
}

pub(crate) type PvRows<'a> = (*mut f32, &'a [usize], &'a [f32], *const f32);

/// `R` rows by `C` 8-column vectors from column `x`, `R * C` accumulators in registers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // a register block's indices, unrolled (const bounds)
pub(crate) unsafe fn pv_block<const R: usize, const C: usize, T: KvElem>(
    (out, row_at, corr, p): PvRows<'_>,
    p_row: usize,
    p_key: usize,
    values: &[*const T],
    x: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for r in 0..R {
        let c = _mm256_set1_ps(corr[r]);
        for v in 0..C {
            let o = out.add(row_at[r] + x + v * 8);
            acc[r][v] = _mm256_mul_ps(_mm256_loadu_ps(o), c);
        }
    }
    for (j, value) in values.iter().enumerate() {
        let mut vv = [_mm256_setzero_ps(); C];
        for (v, vv) in vv.iter_mut().enumerate() {
            *vv = T::load8(value.add(x + v * 8));
        }
        for r in 0..R {
            let w = _mm256_broadcast_ss(&*p.add(r * p_row + j * p_key));
            for v in 0..C {
                acc[r][v] = _mm256_fmadd_ps(w, vv[v], acc[r][v]);
            }
        }
    }
    for r in 0..R {
        for v in 0..C {
            _mm256_storeu_ps(out.add(row_at[r] + x + v * 8), acc[r][v]);
        }
    }
}

/// Reads one byte of every cache line of the `len` elements at `p` (a run of the cache about to
/// be computed on), in address order: the lines come in at the rate of a streaming read (the
/// hardware prefetcher follows a sequential run), not in the order the arithmetic asks for them.
/// Returns the bytes xor-ed (for `black_box`: the reads are the point).
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn touch<T>(p: *const T, len: usize) -> u8 {
    let (start, bytes) = (p as *const u8, len * std::mem::size_of::<T>());
    let mut acc = 0u8;
    let mut at = 0;
    while at < bytes {
        acc ^= std::ptr::read_volatile(start.add(at));
        at += 64;
    }
    acc
}

/// Asks for every cache line of the `len` elements at `p` to be brought into L1 (a hint: nothing
/// waits for it, unlike `touch`'s reads).
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn prefetch<T>(p: *const T, len: usize) {
    let (start, bytes) = (p as *const i8, len * std::mem::size_of::<T>());
    let mut at = 0;
    while at < bytes {
        _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(at));
        at += 64;
    }
}

/// `dst[x] = src[x]` widened to f32 (a quantized row dequantized), `x < d` (a multiple of 8).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn widen<T: KvElem>(src: *const T, dst: *mut f32, d: usize) {
    let factor = _mm256_set1_ps(T::factor(src, d));
    let mut x = 0;
    while x < d {
        let wide = T::load8(src.add(x));
        let wide = if T::EXTRA > 0 {
            _mm256_mul_ps(wide, factor)
        } else {
            wide
        };
        _mm256_storeu_ps(dst.add(x), wide);
        x += 8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::has_avx2_fma;

    #[test]
    fn exp2_is_within_two_ulp_of_f64_over_the_softmax_range() {
        if !has_avx2_fma() {
            return;
        }
        let mut xs: Vec<f32> = (0..40_000).map(|i| -125.9 + i as f32 * 0.003_2).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, -0.5, 0.5, -125.0, 3.25]);
        for chunk in xs.chunks_exact(8) {
            let got = unsafe {
                let mut out = [0.0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), exp2(_mm256_loadu_ps(chunk.as_ptr())));
                out
            };
            for (x, g) in chunk.iter().zip(got) {
                let want = (*x as f64).exp2();
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(
                    ((g as f64) - want).abs() <= 2.0 * ulp as f64,
                    "2^{x} = {g}, want {want}"
                );
            }
        }
    }

    #[test]
    fn scores_of_a_pair_of_rows_are_those_of_each_row_bit_for_bit() {
        use crate::cpu::kv_quant::{Fp8E4M3, KvElem, I8};
        if !has_avx2_fma() {
            return;
        }
        fn check<C: KvElem>() {
            let d = 64;
            let xs = |seed: usize| -> Vec<f32> {
                (0..d)
                    .map(|i| ((i * 31 + seed * 17) % 29) as f32 * 0.11 - 1.5)
                    .collect()
            };
            // eight coded keys, rows of d + EXTRA elements
            let mut rows = vec![unsafe { std::mem::zeroed::<C>() }; 8 * (d + C::EXTRA)];
            for (j, row) in rows.chunks_exact_mut(d + C::EXTRA).enumerate() {
                C::encode(&xs(j + 3), row);
            }
            let keys: [*const C; 8] = std::array::from_fn(|j| rows[j * (d + C::EXTRA)..].as_ptr());
            let (q0, q1) = (xs(40), xs(41));
            let lanes = |v: __m256| {
                let mut out = [0.0f32; 8];
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
                out
            };
            let pair =
                unsafe { qk_keys_in_lanes_rows::<C, 2>([q0.as_ptr(), q1.as_ptr()], &keys, d) };
            for (q, got) in [(&q0, pair[0]), (&q1, pair[1])] {
                let want = unsafe { qk_keys_in_lanes::<C>(q.as_ptr(), &keys, d) };
                assert_eq!(lanes(got), lanes(want));
            }
        }
        check::<I8>();
        check::<Fp8E4M3>();
        check::<f32>();
    }

    #[test]
    fn touch_reads_one_byte_of_every_line_of_the_run() {
        if !has_avx2_fma() {
            return;
        }
        let bytes: Vec<u8> = (0..256u32).map(|i| (i * 37 % 251) as u8).collect();
        // a run of 50 u32 (200 bytes): lines at 0, 64, 128 and 192
        let got = unsafe { touch(bytes.as_ptr() as *const u32, 50) };
        assert_eq!(got, bytes[0] ^ bytes[64] ^ bytes[128] ^ bytes[192]);
        assert_eq!(unsafe { touch(bytes.as_ptr(), 0) }, 0);
    }

    #[test]
    fn exp2_of_minus_infinity_and_of_underflow_is_exactly_zero() {
        if !has_avx2_fma() {
            return;
        }
        let xs = [
            f32::NEG_INFINITY,
            -126.5,
            -200.0,
            -1e30,
            0.0,
            -1.0,
            1.0,
            -126.0,
        ];
        let got = unsafe {
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), exp2(_mm256_loadu_ps(xs.as_ptr())));
            out
        };
        assert_eq!(&got[..4], &[0.0; 4]);
        assert_eq!(&got[4..7], &[1.0, 0.5, 2.0]);
        assert!((got[7] - 2f32.powi(-126)).abs() <= 2.0 * f32::EPSILON * 2f32.powi(-126));
    }
}
