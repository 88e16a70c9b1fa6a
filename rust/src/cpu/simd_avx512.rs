//! The elementwise kernels' 16-lane loops at the AVX-512 level (F, BW, VL): `exp` for SwiGLU's
//! silu. `norm.rs` and `rotary.rs` compile their plain loops for this level as well (the compiler
//! widens them to 512-bit registers); this is the loop it cannot widen by itself.
//!
//! Every lane does what a lane of `simd::exp8` does, so float32 results are bit-identical across
//! the levels: `silu16` takes whole 16-lane chunks, then one 8-lane chunk on `exp8` and the
//! scalar tail, exactly where AVX2 would put them. (Greedy sampling's argmax keeps its AVX2 scan
//! at this level: a 16-lane scan measured 1.1x slower on `[64, 32000]` logits, which stream from
//! memory either way.)

use std::arch::x86_64::*;

use super::simd::{self, LN2_HI, LN2_LO, LOG2E, P};

/// The target features of this level's functions.
macro_rules! avx512_fn {
    ($item:item) => {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        #[inline]
        $item
    };
}

avx512_fn! {
/// `e^x` on 16 lanes: `simd::exp8`'s steps, lane for lane (the same bits).
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL (the ISA level is AVX-512 or above).
pub(super) unsafe fn exp16(x: __m512) -> __m512 {
    let overflow = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(88.722_83));
    let x_in = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-87.0)),
        _mm512_set1_ps(88.0),
    );
    // round to nearest even, as `_mm256_round_ps` does in exp8
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x_in, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x_in);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut y = _mm512_set1_ps(P[0]);
    for c in &P[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(_mm512_mul_ps(r, r), y, r),
        _mm512_set1_ps(1.0),
    );
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
    let e = _mm512_mask_blend_ps(overflow, e, _mm512_set1_ps(f32::INFINITY));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_blend_ps(nan, e, x)
}
}

avx512_fn! {
/// `x / (1 + exp(-x))` over `xs`' whole 16-lane chunks, then one 8-lane chunk (`exp8`) if 8 or
/// more elements are left; returns how many elements it did (the rest is the scalar tail that
/// the AVX2 loop leaves too).
///
/// # Safety
/// As `exp16`.
pub(super) unsafe fn silu16(xs: &mut [f32]) -> usize {
    let n = xs.len();
    let p = xs.as_mut_ptr();
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    // every access covers i..i + 16 <= n
    while i + 16 <= n {
        let x = _mm512_loadu_ps(p.add(i));
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(x),
            _mm512_set1_epi32(i32::MIN),
        ));
        _mm512_storeu_ps(p.add(i), _mm512_div_ps(x, _mm512_add_ps(one, exp16(neg))));
        i += 16;
    }
    if i + 8 <= n {
        let x = _mm256_loadu_ps(p.add(i));
        let e = simd::exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0)));
        _mm256_storeu_ps(p.add(i), _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e)));
        i += 8;
    }
    i
}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::isa::{self, IsaLevel};

    fn avx512() -> bool {
        isa::level() >= IsaLevel::Avx512
    }

    #[test]
    fn exp16_gives_exp8s_bits_lane_for_lane() {
        if !avx512() {
            return; // the AVX-512 kernels run only at that level (CI tests each level it has)
        }
        let mut xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.047).collect();
        xs.extend([
            -200.0,
            -87.5,
            88.5,
            89.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
        ]);
        xs.resize(xs.len().next_multiple_of(16), 1.0);
        for chunk in xs.chunks_exact(16) {
            let mut wide = [0.0f32; 16];
            let mut narrow = [0.0f32; 16];
            // SAFETY: the level is AVX-512 (checked above), which includes AVX2 + FMA.
            unsafe {
                _mm512_storeu_ps(wide.as_mut_ptr(), exp16(_mm512_loadu_ps(chunk.as_ptr())));
                for h in 0..2 {
                    let v = simd::exp8(_mm256_loadu_ps(chunk.as_ptr().add(8 * h)));
                    _mm256_storeu_ps(narrow.as_mut_ptr().add(8 * h), v);
                }
            }
            for l in 0..16 {
                assert_eq!(wide[l].to_bits(), narrow[l].to_bits(), "exp({})", chunk[l]);
            }
        }
    }
}
