//! AVX-512 (F, BW, VL) inner loops of the paged attention kernel (`attention`), for head sizes
//! that are a multiple of 8: the AVX2 path's (`attention_avx2`) on 16 lanes, with the same sums in
//! the same order, so that both levels give the same bits.
//! - rows in lanes (prefill): each lane is one row's own sum over the head's columns (`qk_block`)
//!   or over the keys (`softmax_rows_in_lanes`, `pv`), so 16 rows per vector change no order; a
//!   last vector of 8 rows is masked.
//! - keys in lanes (decode, `qk_keys_in_lanes`): the AVX2 path keeps one 8-lane sum per key
//!   (column x in lane x % 8) and folds eight of them with a tree of pairwise adds; here one
//!   register holds two keys' 8-lane sums (`load8x2`), and the fold, done by shuffles and adds
//!   per 128-bit block, adds the same pairs in the same tree. Sixteen keys per call.
//! - `pv`: each output column is its own sum over the keys: 16 columns per vector, the same
//!   order.
//!
//! Every function here is `unsafe`: callers run at the AVX-512 level (`isa::level()`, which
//! includes the AVX2 level's avx2, fma and f16c) and pass pointers valid for the lengths described.
#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::attention_avx2 as avx2;
use super::kv_quant::KvElem;

/// `attention_avx2::exp2` on 16 lanes: the same operations, so the same bits lane by lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn exp2(x: __m512) -> __m512 {
    let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-126.0));
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-126.0)),
        _mm512_set1_ps(127.0),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let f = _mm512_sub_ps(x, n);
    let mut p = _mm512_set1_ps(avx2::EXP2_C[0]);
    for c in &avx2::EXP2_C[1..] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(*c));
    }
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_maskz_mov_ps(!underflow, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)))
}

/// The mask of a vector of rows: all 16 lanes, or the first 8 (`rp` rows, a multiple of 8, end
/// inside it).
#[inline(always)]
fn lanes(rp: usize, v: usize) -> __mmask16 {
    if rp - v >= 16 {
        0xffff
    } else {
        0x00ff
    }
}

/// `attention_avx2::qk_rows_in_lanes` (`s[j * rp + r] = sum_x keys[j][x] * qt[x * rp + r]`,
/// `rp` a multiple of 8) with 16 rows per vector.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn qk_rows_in_lanes(
    qt: *const f32,
    rp: usize,
    keys: &[*const f32],
    d: usize,
    s: *mut f32,
) {
    let vecs = rp.div_ceil(16);
    let mut v0 = 0;
    while v0 < vecs {
        let rv = (vecs - v0).min(4);
        // the block's last vector: 8 rows where rp ends inside it
        let tail = lanes(rp, (v0 + rv - 1) * 16);
        // enough keys per block for eight or more independent sums (FMA latency x ports)
        let kb = match rv {
            1 => 6,
            2 => 4,
            _ => 3,
        };
        let (qt, s) = (qt.add(v0 * 16), s.add(v0 * 16));
        let mut j = 0;
        while j < keys.len() {
            let (block, s) = if keys.len() - j >= kb {
                (&keys[j..j + kb], s.add(j * rp))
            } else {
                (&keys[j..j + 1], s.add(j * rp))
            };
            match (block.len(), rv) {
                (6, _) => qk_block::<6, 1>(qt, rp, block, d, s, tail),
                (4, _) => qk_block::<4, 2>(qt, rp, block, d, s, tail),
                (3, 3) => qk_block::<3, 3>(qt, rp, block, d, s, tail),
                (3, _) => qk_block::<3, 4>(qt, rp, block, d, s, tail),
                (_, 1) => qk_block::<1, 1>(qt, rp, block, d, s, tail),
                (_, 2) => qk_block::<1, 2>(qt, rp, block, d, s, tail),
                (_, 3) => qk_block::<1, 3>(qt, rp, block, d, s, tail),
                (_, _) => qk_block::<1, 4>(qt, rp, block, d, s, tail),
            }
            j += block.len();
        }
        v0 += rv;
    }
}

/// `KB` keys by `RV` 16-row vectors of the scores in registers; the last vector's lanes `tail`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // a register block's indices, unrolled (const bounds)
unsafe fn qk_block<const KB: usize, const RV: usize>(
    qt: *const f32,
    rp: usize,
    keys: &[*const f32],
    d: usize,
    s: *mut f32,
    tail: __mmask16,
) {
    let mut acc = [[_mm512_setzero_ps(); RV]; KB];
    let mut k = [std::ptr::null::<f32>(); KB];
    k.copy_from_slice(&keys[..KB]);
    for x in 0..d {
        let row = qt.add(x * rp);
        let mut q = [_mm512_setzero_ps(); RV];
        for (v, q) in q.iter_mut().enumerate() {
            let mask = if v + 1 == RV { tail } else { 0xffff };
            *q = _mm512_maskz_loadu_ps(mask, row.add(v * 16));
        }
        for b in 0..KB {
            let key = _mm512_set1_ps(*k[b].add(x));
            for v in 0..RV {
                acc[b][v] = _mm512_fmadd_ps(key, q[v], acc[b][v]);
            }
        }
    }
    for b in 0..KB {
        for v in 0..RV {
            let mask = if v + 1 == RV { tail } else { 0xffff };
            _mm512_mask_storeu_ps(s.add(b * rp + v * 16), mask, acc[b][v]);
        }
    }
}

/// `attention_avx2::softmax_rows_in_lanes` with 16 rows per vector (lane by lane the same).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn softmax_rows_in_lanes(
    s: *mut f32,
    rp: usize,
    n: usize,
    max: &mut [f32],
    sum: &mut [f32],
    corr: &mut [f32],
) {
    for v in (0..rp).step_by(16) {
        let m = lanes(rp, v);
        let mut tile_max = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in 0..n {
            tile_max = _mm512_max_ps(tile_max, _mm512_maskz_loadu_ps(m, s.add(j * rp + v)));
        }
        let old = _mm512_maskz_loadu_ps(m, max.as_ptr().add(v));
        let new = _mm512_max_ps(old, tile_max);
        // measured from 0 while the max is -inf (no key seen): no -inf - -inf
        let none = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(new, _mm512_set1_ps(f32::NEG_INFINITY));
        let base = _mm512_maskz_mov_ps(!none, new);
        let mut total = _mm512_setzero_ps();
        for j in 0..n {
            let at = s.add(j * rp + v);
            let p = exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, at), base));
            _mm512_mask_storeu_ps(at, m, p);
            total = _mm512_add_ps(total, p);
        }
        let c = exp2(_mm512_sub_ps(old, base));
        let running = _mm512_maskz_loadu_ps(m, sum.as_ptr().add(v));
        _mm512_mask_storeu_ps(
            sum.as_mut_ptr().add(v),
            m,
            _mm512_fmadd_ps(running, c, total),
        );
        _mm512_mask_storeu_ps(max.as_mut_ptr().add(v), m, new);
        _mm512_mask_storeu_ps(corr.as_mut_ptr().add(v), m, c);
    }
}

/// Pairwise sums of adjacent lanes, per 128-bit block: `[a0 + a1, a2 + a3, b0 + b1, b2 + b3]`
/// (`_mm256_hadd_ps`'s, block by block).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn hadd(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}

/// What the keys-in-lanes q rows are multiplied by (`q_lift`, a power of two) for keys of `C`:
/// its lifted loads (`KvElem::load8x2_lifted`) are short of the values by `C::LIFT` (e4m3: 2^120),
/// and q lifted by all but 2^20 of it keeps the products where they would be near f32's normal
/// range (scaled by 2^-20: never subnormal for a q above 2^-97), without q overflowing below 2^28.
/// Every scaling is by a power of two, so the scores' bits do not change.
#[inline(always)]
pub(crate) fn q_lift<C: KvElem>() -> f32 {
    if C::LIFT > 1.0 {
        C::LIFT * (1.0 / (1u32 << 20) as f32)
    } else {
        1.0
    }
}

/// What `qk_keys_in_lanes` multiplies a key row's factor by: what the lifted lanes and q left
/// out (exact: a power of two).
#[inline(always)]
pub(crate) fn key_unlift<C: KvElem>() -> f32 {
    C::LIFT / q_lift::<C>()
}

/// The sixteen quantized rows at `base + at[l] + offset` (`offset`: the kv head's place in the
/// position plus `d`, where each row's scale byte lies) each have factor
/// `C::byte_factor(scale byte) * times`: the bytes read one by one (as fast here as two gathers),
/// the factors computed in the lanes.
///
/// # Safety
/// `C` is a one-byte format; every `base + at[l] + offset` is a row's scale byte.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn row_factors<C: KvElem>(
    base: *const C,
    at: &[usize; 16],
    offset: usize,
    times: f32,
) -> __m512 {
    debug_assert_eq!(std::mem::size_of::<C>(), 1);
    let start = (base as *const u8).add(offset);
    let bytes: [u8; 16] = std::array::from_fn(|l| *start.add(at[l]));
    let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.as_ptr() as *const __m128i));
    _mm512_mul_ps(C::byte_factor16(bytes), _mm512_set1_ps(times))
}

/// `attention_avx2::scale_by_values` for one row's `n` probabilities at `p` (contiguous) given
/// each value's `factor * lift` in `factors` (`n` of them): 16 at a time, the same products.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn scale_row(p: *mut f32, factors: *const f32, n: usize) {
    let mut j = 0;
    while j < n {
        let m: __mmask16 = if n - j >= 16 {
            0xffff
        } else {
            (1u16 << (n - j)) - 1
        };
        let at = p.add(j);
        let scaled = _mm512_mul_ps(
            _mm512_maskz_loadu_ps(m, at),
            _mm512_maskz_loadu_ps(m, factors.add(j)),
        );
        _mm512_mask_storeu_ps(at, m, scaled);
        j += 16;
    }
}

/// `attention_avx2::qk_keys_in_lanes_rows` for 16 keys: `R` rows' 16 scores `q[r] . keys[j]`
/// (each times its row's factor for quantized keys), bit for bit the AVX2 path's two calls on
/// keys 0-7 and 8-15, given each q row times `q_lift::<C>()`.
///
/// `factors`: each key's `C::factor` times `key_unlift::<C>()` (16 values; not read for plain f32 / bf16 keys), found
/// once per key by the caller for every head's rows instead of here per call.
///
/// Register `i` holds key `KEY_LO[i]`'s 8-lane sum in lanes 0-7 and key `KEY_LO[i] + 4`'s in
/// lanes 8-15: after the fold (two rounds of `hadd`, then the low quads' sums plus the high
/// quads'), lane `l` holds key `l`'s sum, `((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`, the
/// tree of the AVX2 fold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn qk_keys_in_lanes<C: KvElem, const R: usize>(
    q: [*const f32; R],
    keys: &[*const C; 16],
    d: usize,
    factors: *const f32,
) -> [__m512; R] {
    const KEY_LO: [usize; 8] = [0, 1, 2, 3, 8, 9, 10, 11];
    let mut acc = [[_mm512_setzero_ps(); 8]; R];
    let mut x = 0;
    while x < d {
        // columns x..x + 8 of each row in both halves
        let qv: [__m512; R] = std::array::from_fn(|r| {
            let eight = _mm256_castps_pd(_mm256_loadu_ps(q[r].add(x)));
            _mm512_castpd_ps(_mm512_broadcast_f64x4(eight))
        });
        for (i, &lo) in KEY_LO.iter().enumerate() {
            let kv = C::load8x2_lifted(keys[lo].add(x), keys[lo + 4].add(x));
            for r in 0..R {
                acc[r][i] = _mm512_fmadd_ps(qv[r], kv, acc[r][i]);
            }
        }
        x += 8;
    }
    let plain = C::EXTRA == 0 && C::LIFT == 1.0;
    let factors = if !plain {
        _mm512_loadu_ps(factors)
    } else {
        _mm512_setzero_ps()
    };
    std::array::from_fn(|r| {
        let a = &acc[r];
        // blocks: [keys 0-3 low quads, 0-3 high quads, 4-7 low, 4-7 high], then 8-15 alike
        let first = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
        let second = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
        let low = _mm512_shuffle_f32x4::<0b10_00_10_00>(first, second);
        let high = _mm512_shuffle_f32x4::<0b11_01_11_01>(first, second);
        let scores = _mm512_add_ps(low, high);
        if plain {
            scores
        } else {
            _mm512_mul_ps(scores, factors)
        }
    })
}

/// `attention_avx2::pv` with 16 columns per vector (each column's sum in the same order), the
/// values read by the lifted loads: `p` must be the AVX2 path's times `T::LIFT` (exact).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
        let rb = (row_at.len() - r).min(4);
        let args = (out, &row_at[r..r + rb], &corr[r..r + rb], p.add(r * p_row));
        let mut x = 0;
        while x < d {
            let step = match d - x {
                64.. => 64,
                16.. => 16,
                _ => 8,
            };
            match (rb, step) {
                (4, 64) => pv_block::<4, 4, T>(args, p_row, p_key, values, x),
                (3, 64) => pv_block::<3, 4, T>(args, p_row, p_key, values, x),
                (2, 64) => pv_block::<2, 4, T>(args, p_row, p_key, values, x),
                (_, 64) => pv_block::<1, 4, T>(args, p_row, p_key, values, x),
                (4, 16) => pv_block::<4, 1, T>(args, p_row, p_key, values, x),
                (3, 16) => pv_block::<3, 1, T>(args, p_row, p_key, values, x),
                (2, 16) => pv_block::<2, 1, T>(args, p_row, p_key, values, x),
                (_, 16) => pv_block::<1, 1, T>(args, p_row, p_key, values, x),
                // the last 8 columns of a head size not a multiple of 16
                (4, _) => pv_block8::<4, T>(args, p_row, p_key, values, x),
                (3, _) => pv_block8::<3, T>(args, p_row, p_key, values, x),
                (2, _) => pv_block8::<2, T>(args, p_row, p_key, values, x),
                (_, _) => pv_block8::<1, T>(args, p_row, p_key, values, x),
            }
            x += step;
        }
        r += rb;
    }
}

/// `R` rows by `C` 16-column vectors from column `x`, `R * C` accumulators in registers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // a register block's indices, unrolled (const bounds)
unsafe fn pv_block<const R: usize, const C: usize, T: KvElem>(
    (out, row_at, corr, p): avx2::PvRows<'_>,
    p_row: usize,
    p_key: usize,
    values: &[*const T],
    x: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for r in 0..R {
        let c = _mm512_set1_ps(corr[r]);
        for v in 0..C {
            let o = out.add(row_at[r] + x + v * 16);
            acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o), c);
        }
    }
    for (j, value) in values.iter().enumerate() {
        let mut vv = [_mm512_setzero_ps(); C];
        for (v, vv) in vv.iter_mut().enumerate() {
            *vv = T::load16_lifted(value.add(x + v * 16));
        }
        for r in 0..R {
            let w = _mm512_set1_ps(*p.add(r * p_row + j * p_key));
            for v in 0..C {
                acc[r][v] = _mm512_fmadd_ps(w, vv[v], acc[r][v]);
            }
        }
    }
    for r in 0..R {
        for v in 0..C {
            _mm512_storeu_ps(out.add(row_at[r] + x + v * 16), acc[r][v]);
        }
    }
}

/// `pv_block` on the 8 columns from `x` (the lifted lanes of 8 values: the low half of a
/// `load8x2_lifted` of them twice).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // a register block's indices, unrolled (const bounds)
unsafe fn pv_block8<const R: usize, T: KvElem>(
    (out, row_at, corr, p): avx2::PvRows<'_>,
    p_row: usize,
    p_key: usize,
    values: &[*const T],
    x: usize,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    for r in 0..R {
        let o = out.add(row_at[r] + x);
        acc[r] = _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(corr[r]));
    }
    for (j, value) in values.iter().enumerate() {
        let at = value.add(x);
        let vv = _mm512_castps512_ps256(T::load8x2_lifted(at, at));
        for r in 0..R {
            let w = _mm256_set1_ps(*p.add(r * p_row + j * p_key));
            acc[r] = _mm256_fmadd_ps(w, vv, acc[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(out.add(row_at[r] + x), acc[r]);
    }
}

/// `attention_avx2::widen` 16 values at a time (`d` a multiple of 8).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn widen<T: KvElem>(src: *const T, dst: *mut f32, d: usize) {
    let factor = T::factor(src, d);
    let mut x = 0;
    while x + 16 <= d {
        let wide = T::load16(src.add(x));
        let wide = if T::EXTRA > 0 {
            _mm512_mul_ps(wide, _mm512_set1_ps(factor))
        } else {
            wide
        };
        _mm512_storeu_ps(dst.add(x), wide);
        x += 16;
    }
    if x < d {
        let wide = T::load8(src.add(x));
        let wide = if T::EXTRA > 0 {
            _mm256_mul_ps(wide, _mm256_set1_ps(factor))
        } else {
            wide
        };
        _mm256_storeu_ps(dst.add(x), wide);
    }
}

#[cfg(test)]
mod tests {
    //! Each loop against its AVX2 twin, bit for bit (the kernel end to end: `attention_tests`).
    use super::*;
    use crate::cpu::elem::Bf16;
    use crate::cpu::isa::{level, IsaLevel};
    use crate::cpu::kv_quant::{Fp8E4M3, Fp8E5M2, I8};

    fn avx512() -> bool {
        level() >= IsaLevel::Avx512
    }

    fn xs(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 31 + seed * 17) % 29) as f32 * 0.11 - 1.5) * (1.0 + i as f32 * 1e-3))
            .collect()
    }

    /// `count` coded rows of `d` values (and the scale) each.
    fn rows<C: KvElem>(count: usize, d: usize) -> Vec<C> {
        let mut rows = vec![unsafe { std::mem::zeroed::<C>() }; count * (d + C::EXTRA)];
        for (j, row) in rows.chunks_exact_mut(d + C::EXTRA).enumerate() {
            C::encode(&xs(d, j + 3), row);
        }
        rows
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn exp2_is_the_avx2_exp2_bit_for_bit() {
        if !avx512() {
            return;
        }
        let mut xs: Vec<f32> = (0..20_000).map(|i| -130.0 + i as f32 * 0.0067).collect();
        xs.extend([
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            127.5,
            -126.0,
            1e-8,
            -1e-8,
            3.25,
        ]);
        xs.resize(xs.len().next_multiple_of(16), 0.5);
        for chunk in xs.chunks_exact(16) {
            let (mut wide, mut want) = ([0.0f32; 16], [0.0f32; 16]);
            unsafe {
                _mm512_storeu_ps(wide.as_mut_ptr(), exp2(_mm512_loadu_ps(chunk.as_ptr())));
                for h in 0..2 {
                    let v = avx2::exp2(_mm256_loadu_ps(chunk.as_ptr().add(8 * h)));
                    _mm256_storeu_ps(want.as_mut_ptr().add(8 * h), v);
                }
            }
            assert_eq!(bits(&wide), bits(&want), "{chunk:?}");
        }
    }

    #[test]
    fn sixteen_keys_in_lanes_score_as_two_avx2_calls_bit_for_bit() {
        if !avx512() {
            return;
        }
        fn check<C: KvElem>(d: usize) {
            let cache = rows::<C>(16, d);
            let row = d + C::EXTRA;
            // keys out of order in the cache, as a block table scatters them
            let keys: [*const C; 16] =
                std::array::from_fn(|j| cache[((j * 7) % 16) * row..].as_ptr());
            let (q0, q1) = (xs(d, 40), xs(d, 41));
            // the AVX-512 loop takes q lifted (exact: a power of two)
            let lifted = |q: &[f32]| q.iter().map(|x| x * q_lift::<C>()).collect::<Vec<_>>();
            let (l0, l1) = (lifted(&q0), lifted(&q1));
            let lanes = |v: __m512| {
                let mut out = [0.0f32; 16];
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
                out
            };
            let unlift = key_unlift::<C>();
            let factors: [f32; 16] =
                std::array::from_fn(|l| unsafe { C::factor(keys[l], d) } * unlift);
            let f = factors.as_ptr();
            let pair = unsafe { qk_keys_in_lanes::<C, 2>([l0.as_ptr(), l1.as_ptr()], &keys, d, f) };
            let one = unsafe { qk_keys_in_lanes::<C, 1>([l1.as_ptr()], &keys, d, f) };
            for (q, got) in [(&q0, pair[0]), (&q1, pair[1]), (&q1, one[0])] {
                let mut want = [0.0f32; 16];
                for h in 0..2 {
                    let eight: &[*const C; 8] = keys[8 * h..8 * h + 8].try_into().unwrap();
                    let v = unsafe { avx2::qk_keys_in_lanes::<C>(q.as_ptr(), eight, d) };
                    unsafe { _mm256_storeu_ps(want.as_mut_ptr().add(8 * h), v) };
                }
                assert_eq!(bits(&lanes(got)), bits(&want), "d {d}");
            }
        }
        for d in [64, 128, 40, 8] {
            check::<f32>(d);
            check::<Bf16>(d);
            check::<I8>(d);
            check::<Fp8E4M3>(d);
            check::<Fp8E5M2>(d);
        }
    }

    #[test]
    fn pv_is_the_avx2_pv_bit_for_bit_for_every_head_size_and_row_count() {
        if !avx512() {
            return;
        }
        fn check<C: KvElem>(d: usize, rows_n: usize, keys: usize) {
            let cache = rows::<C>(keys, d);
            let values: Vec<*const C> = (0..keys)
                .map(|j| cache[((j * 5) % keys) * (d + C::EXTRA)..].as_ptr())
                .collect();
            let p = xs(rows_n * keys, 7);
            let corr: Vec<f32> = (0..rows_n).map(|r| 0.5 + r as f32 * 0.125).collect();
            // rows scattered in the output, as the heads of a GQA group are
            let row_at: Vec<usize> = (0..rows_n).map(|r| (rows_n - 1 - r) * (d + 8)).collect();
            let start = xs(rows_n * (d + 8), 9);
            let (mut got, mut want) = (start.clone(), start);
            // the AVX-512 loop takes p times the lifted loads' power of two (exact)
            let lifted: Vec<f32> = p.iter().map(|x| x * C::LIFT).collect();
            let vals = values.as_slice();
            unsafe {
                pv(
                    got.as_mut_ptr(),
                    &row_at,
                    &corr,
                    lifted.as_ptr(),
                    keys,
                    1,
                    vals,
                    d,
                );
                avx2::pv(
                    want.as_mut_ptr(),
                    &row_at,
                    &corr,
                    p.as_ptr(),
                    keys,
                    1,
                    vals,
                    d,
                );
            }
            assert_eq!(bits(&got), bits(&want), "d {d} rows {rows_n}");
        }
        for d in [64, 128, 24, 40, 8, 96] {
            for rows_n in [1, 2, 3, 5, 9] {
                check::<f32>(d, rows_n, 13);
                check::<Bf16>(d, rows_n, 13);
                check::<I8>(d, rows_n, 13);
                check::<Fp8E4M3>(d, rows_n, 13);
                check::<Fp8E5M2>(d, rows_n, 13);
            }
        }
    }

    #[test]
    fn rows_in_lanes_scores_and_softmax_are_the_avx2_ones_bit_for_bit() {
        if !avx512() {
            return;
        }
        for (rp, n, d) in [
            (8, 64, 64),
            (16, 64, 64),
            (24, 37, 32),
            (32, 64, 128),
            (40, 5, 8),
        ] {
            let qt = xs(d * rp, 3);
            let cache = xs(n * d, 4);
            let keys: Vec<*const f32> = (0..n).map(|j| cache[j * d..].as_ptr()).collect();
            let (mut got, mut want) = (vec![0.0f32; n * rp], vec![0.0f32; n * rp]);
            unsafe {
                qk_rows_in_lanes(qt.as_ptr(), rp, &keys, d, got.as_mut_ptr());
                avx2::qk_rows_in_lanes(qt.as_ptr(), rp, &keys, d, want.as_mut_ptr());
            }
            assert_eq!(bits(&got), bits(&want), "scores rp {rp} n {n} d {d}");
            // a running state with rows that saw no key yet (-inf) beside ones that did
            let max: Vec<f32> = (0..rp)
                .map(|r| {
                    if r % 3 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        r as f32 * 0.25
                    }
                })
                .collect();
            let sum: Vec<f32> = (0..rp).map(|r| r as f32 * 0.5).collect();
            let mut a = (max.clone(), sum.clone(), vec![0.0f32; rp]);
            let mut b = (max, sum, vec![0.0f32; rp]);
            unsafe {
                softmax_rows_in_lanes(got.as_mut_ptr(), rp, n, &mut a.0, &mut a.1, &mut a.2);
                avx2::softmax_rows_in_lanes(want.as_mut_ptr(), rp, n, &mut b.0, &mut b.1, &mut b.2);
            }
            assert_eq!(bits(&got), bits(&want), "probabilities rp {rp}");
            assert_eq!(
                (bits(&a.0), bits(&a.1)),
                (bits(&b.0), bits(&b.1)),
                "rp {rp}"
            );
            assert_eq!(bits(&a.2), bits(&b.2), "corrections rp {rp}");
        }
    }

    #[test]
    fn widen_is_the_avx2_widen_bit_for_bit() {
        if !avx512() {
            return;
        }
        fn check<C: KvElem>(d: usize) {
            let cache = rows::<C>(1, d);
            let (mut got, mut want) = (vec![0.0f32; d], vec![0.0f32; d]);
            unsafe {
                widen(cache.as_ptr(), got.as_mut_ptr(), d);
                avx2::widen(cache.as_ptr(), want.as_mut_ptr(), d);
            }
            assert_eq!(bits(&got), bits(&want), "d {d}");
        }
        for d in [64, 24, 8, 128] {
            check::<Bf16>(d);
            check::<I8>(d);
            check::<Fp8E4M3>(d);
            check::<Fp8E5M2>(d);
        }
    }
}
