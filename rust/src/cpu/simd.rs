//! Vector loops for the CPU kernels, written as fixed 8-lane chunks so that the compiler turns
//! them into one AVX register op per chunk. `F` selects fused multiply-add: the kernels are
//! instantiated once with `F = true` inside an `avx2,fma` function (run where the ISA level,
//! `isa::level()`, is AVX2 or above) and once with `F = false` for any other level or CPU (where
//! `mul_add` would be a libm call).
//! The cache-side operand of `dot` and `axpy` is any kernel element (`Elem`): bf16 widens to f32
//! as it is loaded, the arithmetic stays in f32.

use super::elem::Elem;

pub(crate) const LANES: usize = 8;

/// Whether the kernels run their `avx2,fma` functions (the one check before calling any): the
/// process's ISA level (`isa`, the machine's or a lower forced one) is AVX2 or above.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
    super::isa::level() >= super::isa::IsaLevel::Avx2
}

#[inline(always)]
fn madd<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
    if F {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `sum(a[i] * b[i])` over equal-length slices. With `F` (avx2 + fma available) two 8-lane
/// accumulators in registers; otherwise 8 scalar partial sums.
#[inline(always)]
pub(crate) fn dot<const F: bool, T: Elem>(a: &[f32], b: &[T]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if F {
        // SAFETY: `F` is true only inside functions compiled for avx2 + fma, which run only
        // after the CPU was checked for both (attention::run).
        return unsafe { dot_avx2_fma(a, b) };
    }
    let mut acc = [0.0f32; LANES];
    let (ac, ar) = a.split_at(a.len() - a.len() % LANES);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(LANES).zip(bc.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = madd::<F>(x[l], y[l].to_f32(), acc[l]);
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ar.iter().zip(br) {
        tail = madd::<F>(*x, y.to_f32(), tail);
    }
    let pairs = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

// LLVM turns the portable loop above into 2-lane ops in some inlining contexts; the dot is the
// kernel's inner loop, so it is spelled out in AVX2 here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn dot_avx2_fma<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut s0 = _mm256_setzero_ps();
    let mut s1 = _mm256_setzero_ps();
    let mut i = 0;
    // every load reads 8 elements at i..i + 8 <= n of both slices
    while i + 16 <= n {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), load8(pb.add(i)), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), load8(pb.add(i + 8)), s1);
        i += 16;
    }
    if i + 8 <= n {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), load8(pb.add(i)), s0);
        i += 8;
    }
    let s = _mm256_add_ps(s0, s1);
    let quad = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    let mut total = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    while i < n {
        total = a[i].mul_add(b[i].to_f32(), total);
        i += 1;
    }
    total
}

/// Eight elements at `p` as f32 lanes: a plain load for f32, for bf16 eight 16-bit loads
/// zero-extended and shifted into the high half of each lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn load8<T: Elem>(p: *const T) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if T::IS_BF16 {
        let halves = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// `y += a * x`.
#[inline(always)]
pub(crate) fn axpy<const F: bool, T: Elem>(y: &mut [f32], a: f32, x: &[T]) {
    debug_assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if F && T::IS_BF16 {
        // SAFETY: as in `dot`. (f32 keeps the loop below, which LLVM vectorizes as it is.)
        return unsafe { axpy_avx2_fma(y, a, x) };
    }
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = madd::<F>(a, xi.to_f32(), *yi);
    }
}

// The widening load spelled out: the loop above widens bf16 lane by lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn axpy_avx2_fma<T: Elem>(y: &mut [f32], a: f32, x: &[T]) {
    use std::arch::x86_64::*;
    let n = y.len().min(x.len());
    let (py, px) = (y.as_mut_ptr(), x.as_ptr());
    let va = _mm256_set1_ps(a);
    let mut i = 0;
    // every access covers i..i + 8 <= n of both slices
    while i + 8 <= n {
        let acc = _mm256_fmadd_ps(va, load8(px.add(i)), _mm256_loadu_ps(py.add(i)));
        _mm256_storeu_ps(py.add(i), acc);
        i += 8;
    }
    while i < n {
        y[i] = a.mul_add(x[i].to_f32(), y[i]);
        i += 1;
    }
}

/// `y *= a`.
#[inline(always)]
pub(crate) fn scale(y: &mut [f32], a: f32) {
    for yi in y.iter_mut() {
        *yi *= a;
    }
}

pub(super) const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in a part exact in few bits and the rest (Cody-Waite), so n * LN2_HI is exact
pub(super) const LN2_HI: f32 = 0.693_359_4;
pub(super) const LN2_LO: f32 = -2.121_944_4e-4;
// minimax coefficients of (e^r - 1 - r) / r^2 on |r| <= ln2 / 2 (Cephes' expf)
pub(super) const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for every element, to about 2 ulp, for x in [-87.3, 88.3] (smaller x give 0, larger
/// are clamped). Branch-free so that it vectorizes (std's `exp` is a scalar libm call).
#[inline(always)]
pub(crate) fn exp_inplace<const F: bool>(xs: &mut [f32]) {
    for x in xs.iter_mut() {
        *x = exp1::<F>(*x);
    }
}

#[inline(always)]
fn exp1<const F: bool>(x: f32) -> f32 {
    let x = x.clamp(-87.336_54, 88.376_26);
    let t = x * LOG2E;
    // round to nearest without libm's round (not vectorized without SSE4.1)
    let n = (t + if t < 0.0 { -0.5 } else { 0.5 }) as i32;
    let nf = n as f32;
    let r = madd::<F>(-nf, LN2_LO, madd::<F>(-nf, LN2_HI, x));
    let mut p = P[0];
    for c in &P[1..] {
        p = madd::<F>(p, r, *c);
    }
    let y = madd::<F>(p, r * r, r) + 1.0;
    // 2^n from the exponent bits; n = -126..=127 here, n = -127 would need a subnormal, and
    // e^x < 1e-38 there anyway: give 0
    let bits = ((n + 127).max(0) as u32) << 23;
    y * f32::from_bits(bits)
}

/// `e^x` on 8 lanes with AVX2 + FMA intrinsics: the polynomial of `exp_inplace`, for loops the
/// compiler does not vectorize by itself (a division or a blend around it). Above ln(f32::MAX)
/// it is +inf, from 88 up to there e^88; below -87 it returns e^-87 (~1.6e-38), which `1 + e^x`
/// cannot tell from 1. NaN stays NaN.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let overflow = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(88.722_83));
    // 88: n <= 127 below, so 2^n is a normal number
    let x_in = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x_in,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x_in);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut y = _mm256_set1_ps(P[0]);
    for c in &P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
    }
    // 1 + r + r^2 * y
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(_mm256_mul_ps(r, r), y, r),
        _mm256_set1_ps(1.0),
    );
    // 2^n from the exponent bits: n + 127 in 2..=254
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    let e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), overflow);
    // NaN in, NaN out (the clamps above would have turned it into a number)
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    _mm256_blendv_ps(e, x, nan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elem::Bf16;

    #[test]
    fn dot_matches_sequential_sum_for_ragged_lengths() {
        for len in [0usize, 1, 7, 8, 9, 31, 32, 40, 64, 67, 129] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64) * (*y as f64))
                .sum();
            let mut got = vec![dot::<false, f32>(&a, &b)];
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                got.push(dot::<true, f32>(&a, &b));
            }
            for got in got {
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "len {len}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn bf16_dot_and_axpy_widen_the_cache_operand_exactly() {
        // values exact in bf16: the bf16 operand must give the f32 result of its widened copy
        for len in [0usize, 1, 7, 8, 9, 16, 17, 40, 64, 67, 129] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<Bf16> = (0..len)
                .map(|i| Bf16::from_f32((i as f32 * 0.11).cos()))
                .collect();
            let wide: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
            let mut pairs = vec![(dot::<false, Bf16>(&a, &b), dot::<false, f32>(&a, &wide))];
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                pairs.push((dot::<true, Bf16>(&a, &b), dot::<true, f32>(&a, &wide)));
            }
            for (got, want) in pairs {
                assert_eq!(got, want, "len {len}");
            }
            let (mut y, mut y_wide) = (a.clone(), a.clone());
            axpy::<false, Bf16>(&mut y, 0.75, &b);
            axpy::<false, f32>(&mut y_wide, 0.75, &wide);
            assert_eq!(y, y_wide);
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                let (mut y, mut y_wide) = (a.clone(), a.clone());
                axpy::<true, Bf16>(&mut y, 0.75, &b);
                axpy::<true, f32>(&mut y_wide, 0.75, &wide);
                assert_eq!(y, y_wide, "len {len}");
            }
        }
    }

    #[test]
    fn exp_is_close_to_std_exp_over_the_softmax_range() {
        let mut xs: Vec<f32> = (0..4000).map(|i| -80.0 + i as f32 * 0.0217).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, 3.5, f32::NEG_INFINITY, -200.0]);
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        let mut got = xs.clone();
        exp_inplace::<false>(&mut got);
        for ((x, g), w) in xs.iter().zip(&got).zip(&want) {
            let tol = 4.0 * f32::EPSILON * w.abs() + 1e-37;
            assert!((g - w).abs() <= tol, "exp({x}) = {g}, want {w}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp8_is_close_to_std_exp_and_keeps_its_range_ends() {
        if !has_avx2_fma() {
            return;
        }
        let mut xs: Vec<f32> = (0..4000).map(|i| -86.0 + i as f32 * 0.0435).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, 3.5, 88.0, -87.0, 0.5, 0.75]);
        xs.truncate(xs.len() / 8 * 8);
        let mut got = vec![0.0f32; xs.len()];
        for (x8, g8) in xs.chunks_exact(8).zip(got.chunks_exact_mut(8)) {
            // SAFETY: the CPU has avx2 and fma (checked above); both pointers cover 8 floats.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_ps(g8.as_mut_ptr(), exp8(_mm256_loadu_ps(x8.as_ptr())));
            }
        }
        for (x, g) in xs.iter().zip(&got) {
            let w = x.exp();
            let tol = 4.0 * f32::EPSILON * w.abs();
            assert!((g - w).abs() <= tol, "exp8({x}) = {g}, want {w}");
        }
        let ends = [
            89.0f32,
            f32::INFINITY,
            -100.0,
            f32::NEG_INFINITY,
            f32::NAN,
            88.5,
            88.0,
            0.0,
        ];
        let mut out = [0.0f32; 8];
        // SAFETY: as above.
        unsafe {
            use std::arch::x86_64::*;
            _mm256_storeu_ps(out.as_mut_ptr(), exp8(_mm256_loadu_ps(ends.as_ptr())));
        }
        assert_eq!(out[..2], [f32::INFINITY; 2]);
        let floor = (-87.0f32).exp();
        assert!(
            (out[2] - floor).abs() <= 4.0 * f32::EPSILON * floor,
            "{}",
            out[2]
        );
        assert_eq!(out[2], out[3]);
        assert!(out[4].is_nan());
        assert_eq!(out[5], out[6]);
    }

    #[test]
    fn axpy_and_scale_are_elementwise() {
        let mut y = vec![1.0f32; 11];
        let x: Vec<f32> = (0..11).map(|i| i as f32).collect();
        axpy::<false, f32>(&mut y, 2.0, &x);
        scale(&mut y, 0.5);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, (1.0 + 2.0 * i as f32) * 0.5);
        }
    }
}
