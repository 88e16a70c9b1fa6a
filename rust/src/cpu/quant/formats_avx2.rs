//! `formats::dequantize_blocks` in AVX2, eight elements a register: the same products and
//! sums in the same order (no fused multiply-add), so the results equal the portable rows bit
//! for bit. The scales are widened with the portable `f16_to_f32` (one or two per block); F16
//! rows use F16C's conversion (exact).
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::formats::{f16_to_f32, k_scale_min, QType};

/// Whether this process runs the functions here (AVX2, FMA for the kernels around them, F16C:
/// `isa`'s AVX2 level, which a forced `PAGEDLLM_CPU_ISA=portable` turns off).
pub fn available() -> bool {
    crate::cpu::isa::level() >= crate::cpu::isa::IsaLevel::Avx2
}

/// `formats::dequantize_blocks`, vectorized.
///
/// # Safety
/// The CPU supports avx2, fma and f16c (`available`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_blocks(t: QType, src: &[u8], dst: &mut [f32]) {
    if super::repack::repacked(t) {
        // whole groups of a repacked row, as `formats::dequantize_blocks`
        let plain = super::repack::read_as(t);
        // SAFETY: the caller's CPU has avx2, fma and f16c
        super::repack::dequantize_groups(t, src, dst, |b, y| unsafe {
            dequantize_blocks(plain, b, y)
        });
        return;
    }
    let (elems, bytes) = t.block();
    let blocks = (src.len() / bytes).min(dst.len() / elems);
    let (s, y) = (src.as_ptr(), dst.as_mut_ptr());
    // every block reads src[i * bytes..(i + 1) * bytes] and writes dst[i * elems..(i + 1) * elems]
    match t {
        QType::F32 => std::ptr::copy_nonoverlapping(s, y.cast::<u8>(), blocks * 4),
        QType::F16 => f16_rows(s, y, blocks),
        QType::BF16 => bf16_rows(s, y, blocks),
        _ => {
            for i in 0..blocks {
                let (b, out) = (s.add(i * bytes), y.add(i * elems));
                match t {
                    QType::Q4_0 => q4_0(b, out),
                    QType::Q4_1 => q4_1(b, out),
                    QType::Q5_0 => q5_0(b, out),
                    QType::Q5_1 => q5_1(b, out),
                    QType::Q8_0 => q8_0(b, out),
                    QType::Q4_K => q4_k(b, out),
                    QType::Q5_K => q5_k(b, out),
                    QType::Q6_K => q6_k(b, out),
                    QType::F32
                    | QType::F16
                    | QType::BF16
                    | QType::Q4_0R
                    | QType::Q5_0R
                    | QType::Q8_0R
                    | QType::Q4_1R => {
                        unreachable!()
                    }
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn half(b: *const u8) -> f32 {
    f16_to_f32(u16::from_le_bytes([*b, *b.add(1)]))
}

/// Eight bytes at `p` widened to i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bytes8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_rows(s: *const u8, y: *mut f32, n: usize) {
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(
            y.add(i),
            _mm256_cvtph_ps(_mm_loadu_si128(s.add(2 * i).cast())),
        );
        i += 8;
    }
    for j in i..n {
        *y.add(j) = half(s.add(2 * j));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bf16_rows(s: *const u8, y: *mut f32, n: usize) {
    let mut i = 0;
    while i + 8 <= n {
        let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(s.add(2 * i).cast()));
        _mm256_storeu_ps(y.add(i), _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        i += 8;
    }
    for j in i..n {
        *y.add(j) =
            f32::from_bits(u32::from(u16::from_le_bytes([*s.add(2 * j), *s.add(2 * j + 1)])) << 16);
    }
}

/// The low nibbles (`high` false) or high nibbles of 8 bytes at `p`, as i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles8(p: *const u8, high: bool) -> __m256i {
    let v = bytes8(p);
    let v = if high { _mm256_srli_epi32(v, 4) } else { v };
    _mm256_and_si256(v, _mm256_set1_epi32(0xF))
}

/// Elements 8g..8g + 8 of a 32-element block's 4-bit values (Q4_0 / Q4_1 order).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_group(qs: *const u8, g: usize) -> __m256i {
    nibbles8(qs.add(8 * (g % 2)), g >= 2)
}

/// Elements 8g..8g + 8 of a 32-element block's 5-bit values (Q5_0 / Q5_1): bit 4 of element j
/// is bit j of `qh`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_group(qs: *const u8, qh: u32, g: usize) -> __m256i {
    let bits = _mm256_set1_epi32(((qh >> (8 * g)) & 0xFF) as i32);
    let lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    let set = _mm256_cmpeq_epi32(_mm256_and_si256(bits, lanes), lanes);
    _mm256_or_si256(
        q4_group(qs, g),
        _mm256_and_si256(set, _mm256_set1_epi32(16)),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_0(b: *const u8, y: *mut f32) {
    let d = _mm256_set1_ps(half(b));
    for g in 0..4 {
        let q = _mm256_sub_epi32(q4_group(b.add(2), g), _mm256_set1_epi32(8));
        _mm256_storeu_ps(y.add(8 * g), _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_1(b: *const u8, y: *mut f32) {
    let (d, m) = (_mm256_set1_ps(half(b)), _mm256_set1_ps(half(b.add(2))));
    for g in 0..4 {
        let q = _mm256_cvtepi32_ps(q4_group(b.add(4), g));
        _mm256_storeu_ps(y.add(8 * g), _mm256_add_ps(_mm256_mul_ps(d, q), m));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_0(b: *const u8, y: *mut f32) {
    let d = _mm256_set1_ps(half(b));
    let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
    for g in 0..4 {
        let q = _mm256_sub_epi32(q5_group(b.add(6), qh, g), _mm256_set1_epi32(16));
        _mm256_storeu_ps(y.add(8 * g), _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_1(b: *const u8, y: *mut f32) {
    let (d, m) = (_mm256_set1_ps(half(b)), _mm256_set1_ps(half(b.add(2))));
    let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
    for g in 0..4 {
        let q = _mm256_cvtepi32_ps(q5_group(b.add(8), qh, g));
        _mm256_storeu_ps(y.add(8 * g), _mm256_add_ps(_mm256_mul_ps(d, q), m));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_0(b: *const u8, y: *mut f32) {
    let d = _mm256_set1_ps(half(b));
    for g in 0..4 {
        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * g).cast()));
        _mm256_storeu_ps(y.add(8 * g), _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
    }
}

/// The 32 values of sub-block `i` of a Q4_K / Q5_K super-block, `(d * sc) * q - dmin * m` with
/// `q` the nibbles of `qs` (plus bit i of each qh byte as bit 4, when given).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn k_sub_block(b: *const u8, qs: *const u8, qh: Option<*const u8>, i: usize, y: *mut f32) {
    let scales = std::slice::from_raw_parts(b.add(4), 12);
    let (sc, m) = k_scale_min(scales, i);
    let dl = _mm256_set1_ps(half(b) * sc as f32);
    let ml = _mm256_set1_ps(half(b.add(2)) * m as f32);
    let group = qs.add(32 * (i / 2));
    for p in 0..4 {
        let mut q = nibbles8(group.add(8 * p), i % 2 == 1);
        if let Some(qh) = qh {
            let h = _mm256_srlv_epi32(bytes8(qh.add(8 * p)), _mm256_set1_epi32(i as i32));
            q = _mm256_or_si256(
                q,
                _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(1)), 4),
            );
        }
        let v = _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(q)), ml);
        _mm256_storeu_ps(y.add(32 * i + 8 * p), v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_k(b: *const u8, y: *mut f32) {
    for i in 0..8 {
        k_sub_block(b, b.add(16), None, i, y);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q5_k(b: *const u8, y: *mut f32) {
    for i in 0..8 {
        k_sub_block(b, b.add(48), Some(b.add(16)), i, y);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k(b: *const u8, y: *mut f32) {
    let (ql, qh, scales) = (b, b.add(128), b.add(192));
    let d = half(b.add(208));
    for h in 0..2 {
        for k in 0..4 {
            let low_at = ql.add(64 * h + 32 * (k % 2));
            for p in 0..4 {
                let low = nibbles8(low_at.add(8 * p), k >= 2);
                let high = _mm256_srlv_epi32(
                    bytes8(qh.add(32 * h + 8 * p)),
                    _mm256_set1_epi32(2 * k as i32),
                );
                let high = _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4);
                let q = _mm256_sub_epi32(_mm256_or_si256(low, high), _mm256_set1_epi32(32));
                let e = 128 * h + 32 * k + 8 * p;
                let sc = _mm256_set1_ps(d * (*scales.add(e / 16) as i8) as f32);
                _mm256_storeu_ps(y.add(e), _mm256_mul_ps(sc, _mm256_cvtepi32_ps(q)));
            }
        }
    }
}
