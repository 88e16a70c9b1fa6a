//! The element types of the paged KV cache as the attention kernels read it (`KvElem`): the
//! model's float type (f32 or bf16, a row of `d` values), or a quantized format whose rows carry
//! their own scale.
//!
//! Quantized layout: each (token, kv head) row is its `d` codes followed by one scale byte, so a
//! cache is `[blocks, block_size, KVH, d + 1]` bytes (4d / (d + 1) times float32's tokens in the
//! same memory: 3.94x at d = 64). The scale lives inside the block: every path that moves blocks
//! (copy-on-write, swap, the offload tiers) moves it with them, untouched.
//! - the row is first rotated by a Walsh-Hadamard transform (`hadamard`, over blocks of the
//!   largest power of two dividing `d`): keys after RoPE have a few large channels, and one large
//!   channel sets the whole row's step; rotated, every channel carries a share of it, the row's
//!   max falls towards its RMS and the codes resolve the rest finer. Attention is unchanged by
//!   it: the kernels rotate q the same way (`unrotate`: `H q / n`, so `q' · H k = q · k`) and
//!   rotate the output back (`H (Σ p H v) / n = Σ p v`), once per query row, not per key;
//! - the scale byte codes the row's bound `B >= amax` (of the rotated row), rounded up: an
//!   unsigned float with 5 mantissa bits from 2 to 256, 1 bit on the eight octaves either side
//!   (2^-7 to 2, 256 to 98304; `BAND`); the codes are `x / scale` with `scale = B * (1 / max)`:
//! - int8: symmetric, max 127, `q = round_half_even(x / scale)` in [-127, 127];
//! - fp8 e4m3 (`e4m3fn`: no infinities, max 448) and e5m2 (max 57344): `x / scale` clamped to
//!   ±max, rounded to nearest even, torch's `.to(float8_*)` bit for bit.
//!
//! A row's value is `raw(q) * factor(row)`; the kernels multiply the factor into the score (keys)
//! or the probability (values) once per row, never into each element.
use super::elem::{Bf16, Elem};

/// Bytes of a quantized row's scale, after its `d` values.
pub const SCALE_BYTES: usize = 1;
/// The scale byte's band: bytes 16-239 code bounds with 5 mantissa bits over the 7 octaves from
/// `2^BAND` (2 to 256), bytes 0-15 and 240-255 with 1 bit over the 8 octaves on either side
/// (2^-7 to 2, 256 to 49152). Round 5 kept 3 bits over 32 octaves: the bound up to 1/8 above the
/// row's amax, a share of the code range unused, and the keys' error that flipped most differing
/// tokens (benches/RESULTS.md, round 6). The band holds the rows models write (SmolLM2's rotated
/// rows: 0.33-139); the tails keep round 5's range nearly whole, so another model's rows outside
/// the band are coded with a bound at most 1/2 above their amax rather than clipped (above
/// 49152) or coded with a step far coarser than their values (below 2^-7).
const BAND: i32 = 1;

/// The f32 bits of the bound byte `b` codes.
const fn bound_bits(b: i32) -> u32 {
    let (exponent, mantissa) = if b < 16 {
        (BAND - 8 + (b >> 1), (b & 1) << 22)
    } else if b < 240 {
        (BAND + ((b - 16) >> 5), ((b - 16) & 31) << 18)
    } else {
        (BAND + 7 + ((b - 240) >> 1), ((b - 240) & 1) << 22)
    };
    ((exponent + 127) << 23 | mantissa) as u32
}

/// The keys' scale bytes `KvElem::encode_fed` searches (from the smallest bound >= amax up) in
/// the fp8 formats (`Quantized::SEARCH`; int8 keeps the first: benches/RESULTS.md, round 12).
pub const KEY_BYTES: usize = 8;

/// `KvElem::encode_fed`'s channel loop over `N` candidate rows side by side (`ws`: `N` rows of
/// `d` values, each divided by its candidate's scale): each channel's coded value
/// (`Quantized::rounded`, left in `ws`), its error pushed onto the later channels; returns each
/// row's `sum_j e_j^2 feedback[j, j]`. The rows are independent chains, interleaved so one's
/// latency hides behind the others'.
#[inline(always)]
fn fed_codes<Q: Quantized, const N: usize>(ws: &mut [f32], feedback: &[f32]) -> [f32; N] {
    let d = ws.len() / N;
    let mut acc = [0.0f32; N];
    for j in 0..d {
        let (g, u) = (feedback[j * d + j], &feedback[j * d + j + 1..(j + 1) * d]);
        let mut e = [0.0f32; N];
        for c in 0..N {
            let w = ws[c * d + j];
            let v = Q::rounded(w);
            ws[c * d + j] = v;
            e[c] = w - v;
            acc[c] += e[c] * e[c] * g;
        }
        for (c, e) in e.iter().enumerate() {
            // a multiply then a subtract, each rounded (no fused multiply-add): torch's order
            for (w, u) in ws[c * d + j + 1..(c + 1) * d].iter_mut().zip(u) {
                *w -= e * u;
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn fed_codes_avx512<Q: Quantized, const N: usize>(
    ws: &mut [f32],
    feedback: &[f32],
) -> [f32; N] {
    fed_codes::<Q, N>(ws, feedback)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fed_codes_avx2<Q: Quantized, const N: usize>(
    ws: &mut [f32],
    feedback: &[f32],
) -> [f32; N] {
    fed_codes::<Q, N>(ws, feedback)
}

/// `fed_codes` at the level's widest updates (the same operations at every level).
fn fed_codes_at_level<Q: Quantized, const N: usize>(ws: &mut [f32], feedback: &[f32]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    {
        use super::isa::{level, IsaLevel};
        match level() {
            // SAFETY: the level grants the features
            l if l >= IsaLevel::Avx512 => unsafe { fed_codes_avx512::<Q, N>(ws, feedback) },
            l if l >= IsaLevel::Avx2 => unsafe { fed_codes_avx2::<Q, N>(ws, feedback) },
            _ => fed_codes::<Q, N>(ws, feedback),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    fed_codes::<Q, N>(ws, feedback)
}

/// `encode_fed` with `N` candidate bytes (1: the first alone): the bytes `first..first + N`
/// (at most 255), each row coded by `fed_codes`, the one of least `acc * scale^2` kept (the
/// first of equals). Writes its codes to `values`, returns its byte.
fn encode_fed_n<Q: Quantized, const N: usize>(
    xs: &[f32],
    values: &mut [Q],
    feedback: &[f32],
    first: u8,
) -> u8 {
    let d = xs.len();
    let bytes: [u8; N] = std::array::from_fn(|c| first.saturating_add(c as u8));
    let scales = bytes.map(|b| bound_of(b) * Q::RCP);
    let mut ws = vec![0.0f32; N * d];
    for (w, s) in ws.chunks_exact_mut(d).zip(scales) {
        w.iter_mut().zip(xs).for_each(|(w, x)| *w = x / s);
    }
    let acc = fed_codes_at_level::<Q, N>(&mut ws, feedback);
    let err: [f32; N] = std::array::from_fn(|c| acc[c] * (scales[c] * scales[c]));
    let best = (1..N).fold(0, |best, c| if err[c] < err[best] { c } else { best });
    // the kept row's values are codes' values: coded exactly
    for (q, v) in values.iter_mut().zip(&ws[best * d..(best + 1) * d]) {
        *q = Q::code(*v);
    }
    bytes[best]
}

/// `bound_of` on sixteen bytes (one per 32-bit lane, 0-255): `bound_bits`, each of its three
/// pieces linear in the byte (the mantissa's carry runs into the exponent).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn bounds16(b: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let piece = |first: i32, shift: u32, exponent: i32| {
        let steps = _mm512_sub_epi32(b, _mm512_set1_epi32(first));
        let steps = _mm512_sllv_epi32(steps, _mm512_set1_epi32(shift as i32));
        _mm512_add_epi32(steps, _mm512_set1_epi32((exponent + 127) << 23))
    };
    let band = piece(16, 18, BAND);
    let low = _mm512_cmplt_epi32_mask(b, _mm512_set1_epi32(16));
    let high = _mm512_cmpge_epi32_mask(b, _mm512_set1_epi32(240));
    let bits = _mm512_mask_mov_epi32(band, low, piece(0, 22, BAND - 8));
    let bits = _mm512_mask_mov_epi32(bits, high, piece(240, 22, BAND + 7));
    _mm512_castsi512_ps(bits)
}

/// Every byte's bound, rising.
static BOUNDS: [f32; 256] = {
    let mut table = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = f32::from_bits(bound_bits(b as i32));
        b += 1;
    }
    table
};

/// The row bound a scale byte codes (exact: its bits are built from the byte's).
#[inline(always)]
pub fn bound_of(byte: u8) -> f32 {
    BOUNDS[byte as usize]
}

/// The smallest scale byte whose bound is at least `amax` (>= 0): amax's f32 bits rounded up to
/// 5 (in the band) or 1 (outside) mantissa bits, the carry moving into the exponent; below the
/// smallest bound (a zero row included) byte 0, above the largest byte 255 (the codes then
/// saturate).
#[inline]
pub fn byte_of(amax: f32) -> u8 {
    let bits = amax.to_bits() as i64;
    let (up5, up1) = ((bits + (1 << 18) - 1) >> 18, (bits + (1 << 22) - 1) >> 22);
    let (e5, e1) = ((up5 >> 5) - 127, (up1 >> 1) - 127);
    let band = BAND as i64;
    let byte = if e5 < band {
        ((e1 - band + 8) << 1) + (up1 & 1)
    } else if e5 < band + 7 {
        16 + ((e5 - band) << 5) + (up5 & 31)
    } else {
        240 + ((e1 - band - 7) << 1) + (up1 & 1)
    };
    byte.clamp(0, 255) as u8
}

/// Rows are rotated over blocks of this many values: the largest power of two dividing `d`.
#[inline]
pub fn rotation_block(d: usize) -> usize {
    d & d.wrapping_neg()
}

/// `xs = H xs` per block of `rotation_block(xs.len())` values, H the Sylvester Hadamard matrix
/// (entries ±1, unnormalized: `H H = n I`), as butterflies: for h = 1, 2, 4, .. each pair
/// (a, b) h apart within a 2h run becomes (a + b, a - b).
pub fn hadamard(xs: &mut [f32]) {
    let n = rotation_block(xs.len());
    #[cfg(target_arch = "x86_64")]
    if n >= 16 && super::isa::level() >= super::isa::IsaLevel::Avx512 {
        for block in xs.chunks_exact_mut(n) {
            // SAFETY: the level grants the features; the block is n values, n >= 16 a power of 2
            unsafe { hadamard16(block) };
        }
        return;
    }
    xs.chunks_exact_mut(n.max(1)).for_each(butterflies);
}

/// `hadamard` on one block (a power of two long), a pair at a time.
fn butterflies(block: &mut [f32]) {
    let mut h = 1;
    while h < block.len() {
        for run in block.chunks_exact_mut(2 * h) {
            let (a, b) = run.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// `hadamard` on one block of `n >= 16` values (a power of two), sixteen lanes at a time: the
/// same butterflies, so the same bits (each pair's `a + b` and `a - b` are rounded once, in
/// whatever order the pairs are taken). Runs of h < 16 lie inside one vector: each lane takes
/// its partner (lane ^ h) by a permute, the lanes of a pair's first element keep the sum, the
/// second's the difference (partner - self: a - b).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn hadamard16(block: &mut [f32]) {
    use std::arch::x86_64::*;
    let (n, p) = (block.len(), block.as_mut_ptr());
    let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for v in (0..n).step_by(16) {
        let mut x = _mm512_loadu_ps(p.add(v));
        for (h, second) in [(1, 0xaaaa), (2, 0xcccc), (4, 0xf0f0), (8, 0xff00)] {
            let partner = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(h)), x);
            let (sum, diff) = (_mm512_add_ps(x, partner), _mm512_sub_ps(partner, x));
            x = _mm512_mask_blend_ps(second, sum, diff);
        }
        _mm512_storeu_ps(p.add(v), x);
    }
    let mut h = 16;
    while h < n {
        for run in (0..n).step_by(2 * h) {
            for i in (run..run + h).step_by(16) {
                let (a, b) = (_mm512_loadu_ps(p.add(i)), _mm512_loadu_ps(p.add(i + h)));
                _mm512_storeu_ps(p.add(i), _mm512_add_ps(a, b));
                _mm512_storeu_ps(p.add(i + h), _mm512_sub_ps(a, b));
            }
        }
        h *= 2;
    }
}

/// `xs = H xs / n`: undoes `hadamard` (a rotated row back to its values), and rotates a query
/// so that its dot product with a rotated key is the unrotated one's.
pub fn unrotate(xs: &mut [f32]) {
    hadamard(xs);
    // n is a power of two: exact
    let inverse = 1.0 / rotation_block(xs.len()) as f32;
    xs.iter_mut().for_each(|x| *x *= inverse);
}

/// What the attention kernels and the KV store need of a cache element.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Elements a row holds after its `d` values (the scale's bytes; 0 for float rows).
    const EXTRA: usize;
    /// Not plain f32: the rows-in-lanes path widens a key tile to f32 first.
    const WIDEN: bool;
    /// Rows are stored rotated (`hadamard`): the kernels rotate q and their output (`unrotate`).
    const ROTATED: bool = false;
    /// The element's value before the row's factor.
    fn raw(self) -> f32;
    /// The factor of the row at `row` (its `d` values, then `EXTRA` elements) that `load8`'s
    /// lanes are multiplied by.
    ///
    /// # Safety
    /// `row` must be valid for `d + EXTRA` elements.
    unsafe fn factor(row: *const Self, d: usize) -> f32;
    /// `factor` of a row whose scale byte is `byte` (quantized rows: the factor is a function of
    /// that byte alone, so the kernels can tabulate it; float rows: 1).
    fn byte_factor(byte: u8) -> f32;
    /// `byte_factor` of sixteen scale bytes (one per 32-bit lane, 0-255), the same bits.
    ///
    /// # Safety
    /// The AVX-512 level is granted.
    #[cfg(target_arch = "x86_64")]
    unsafe fn byte_factor16(bytes: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512;
    /// The factor that `raw` values are multiplied by (the row's scale; 1 for float rows).
    ///
    /// # Safety
    /// As `factor`.
    unsafe fn scale(row: *const Self, d: usize) -> f32;
    /// Writes `xs` (`d` values) as one row of `d + EXTRA` elements.
    fn encode(xs: &[f32], row: &mut [Self]);
    /// `encode` with error-feedback rounding (quantized rows; float rows: `encode`): channel by
    /// channel the code of the value so far, its error `e` (in the row's scale units) pushed
    /// onto the later channels as `w_l -= e * feedback[j, l]` (`feedback`: `[d, d]` row-major,
    /// the calibration's pre-divided Cholesky rows above the diagonal, `1 / U_jj^2` on it, zero
    /// below), and in the fp8 formats the scale byte searched: each of the `KEY_BYTES` bytes
    /// from `encode`'s up coded so, the one of least `scale^2 sum_j e_j^2 feedback[j, j]` kept
    /// (a zero diagonal, or int8: `encode`'s byte). `kernels/reference.py`'s `quantize_rows`
    /// bit for bit.
    fn encode_fed(xs: &[f32], row: &mut [Self], feedback: &[f32]) {
        let _ = feedback;
        Self::encode(xs, row)
    }
    /// `xs · row`'s values (factor included), `xs.len()` = `d`; `F`: inside an avx2+fma function.
    fn dot<const F: bool>(xs: &[f32], row: &[Self]) -> f32;
    /// `y += a * row`'s values (factor included).
    fn axpy<const F: bool>(y: &mut [f32], a: f32, row: &[Self]);
    /// Eight values at `p` as f32 lanes, short of the values by the row's `factor`.
    ///
    /// # Safety
    /// avx2, fma and f16c are available, `p` is valid for 8 elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen values at `p` as f32 lanes (the AVX-512 kernels), short of the values by the
    /// row's `factor` as `load8`'s.
    ///
    /// # Safety
    /// The AVX-512 level is granted (`isa::level()`), `p` is valid for 16 elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// `load8(lo)` in lanes 0-7 and `load8(hi)` in lanes 8-15 (two rows' runs of eight: the
    /// AVX-512 kernels keep two keys' 8-lane sums in one register).
    ///
    /// # Safety
    /// As `load16`, `lo` and `hi` each valid for 8 elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512;
    /// A power of two: `load16_lifted`'s lanes times it are `load16`'s (1 but where a widening
    /// ends in a multiply by a power of two, which the lifted loads leave to the caller: e4m3's
    /// 2^120, folded by the AVX-512 attention kernels into a probability or a lifted q).
    const LIFT: f32 = 1.0;
    /// `load16(p) / LIFT`, exactly (subnormal lanes included).
    ///
    /// # Safety
    /// As `load16`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_lifted(p: *const Self) -> std::arch::x86_64::__m512 {
        Self::load16(p)
    }
    /// `load8x2(lo, hi) / LIFT`, exactly.
    ///
    /// # Safety
    /// As `load8x2`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8x2_lifted(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        Self::load8x2(lo, hi)
    }
}

macro_rules! float_kv_elem {
    ($t:ty) => {
        impl KvElem for $t {
            const EXTRA: usize = 0;
            const WIDEN: bool = <$t as Elem>::IS_BF16;
            #[inline(always)]
            fn raw(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            unsafe fn factor(_: *const Self, _: usize) -> f32 {
                1.0
            }
            #[inline(always)]
            fn byte_factor(_: u8) -> f32 {
                1.0
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn byte_factor16(_: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512 {
                std::arch::x86_64::_mm512_set1_ps(1.0)
            }
            #[inline(always)]
            unsafe fn scale(_: *const Self, _: usize) -> f32 {
                1.0
            }
            fn encode(xs: &[f32], row: &mut [Self]) {
                for (r, x) in row.iter_mut().zip(xs) {
                    *r = <$t as Elem>::from_f32(*x);
                }
            }
            #[inline(always)]
            fn dot<const F: bool>(xs: &[f32], row: &[Self]) -> f32 {
                super::simd::dot::<F, $t>(xs, row)
            }
            #[inline(always)]
            fn axpy<const F: bool>(y: &mut [f32], a: f32, row: &[Self]) {
                super::simd::axpy::<F, $t>(y, a, row)
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
                super::simd::load8(p)
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
                load16_float::<$t>(p)
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
                load8x2_float::<$t>(lo, hi)
            }
        }
    };
}

/// Sixteen f32 or bf16 values as f32 lanes (bf16: zero-extended into each lane's high half).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn load16_float<T: Elem>(p: *const T) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    if T::IS_BF16 {
        let halves = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
    } else {
        _mm512_loadu_ps(p as *const f32)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn load8x2_float<T: Elem>(lo: *const T, hi: *const T) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    if T::IS_BF16 {
        let halves = _mm256_loadu2_m128i(hi as *const __m128i, lo as *const __m128i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
    } else {
        // (insertf32x8 is AVX-512 DQ, not in the level: the same move as 64-bit lanes)
        let low = _mm512_castpd256_pd512(_mm256_loadu_pd(lo as *const f64));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            low,
            _mm256_loadu_pd(hi as *const f64),
        ))
    }
}

float_kv_elem!(f32);
float_kv_elem!(Bf16);

/// An int8 cache element (rows: `d` int8 values, then the scale byte).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct I8(pub i8);

/// An fp8 e4m3fn cache element (its bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Fp8E4M3(pub u8);

/// An fp8 e5m2 cache element (its bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Fp8E5M2(pub u8);

/// The quantized formats: how one value is coded, the rest (scale, rows) is shared.
trait Quantized: Copy + Send + Sync + 'static {
    /// The largest magnitude a value codes (the row's bound maps onto it).
    const MAX: f32;
    /// `1 / MAX` in f32: a row's scale is its bound times this.
    const RCP: f32 = 1.0 / Self::MAX;
    /// What `decode8`'s lanes are short of the values by (folded into the row's factor).
    const LANE_FACTOR: f32 = 1.0;
    /// `x` (already divided by the scale) coded.
    fn code(x: f32) -> Self;
    fn decode(self) -> f32;
    /// `code(x).decode()`, the same bits, without the code (the feedback's channel loop).
    fn rounded(x: f32) -> f32;
    /// `KvElem::encode_fed` searches the scale byte (of `KEY_BYTES`).
    const SEARCH: bool = true;
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen codes (the bytes of `codes`) as f32 lanes, short of the values as `decode8`'s.
    /// # Safety
    /// The AVX-512 level is granted.
    #[cfg(target_arch = "x86_64")]
    unsafe fn decode16(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512;
    /// `KvElem::LIFT` and `load16_lifted`'s decoding: `decode16 / LIFT`.
    const LIFT: f32 = 1.0;
    /// # Safety
    /// The AVX-512 level is granted.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode16_lifted(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
        Self::decode16(codes)
    }
}

impl Quantized for I8 {
    const MAX: f32 = 127.0;
    const SEARCH: bool = false;
    #[inline]
    fn code(x: f32) -> Self {
        I8(x.round_ties_even().clamp(-127.0, 127.0) as i8)
    }
    #[inline(always)]
    fn rounded(x: f32) -> f32 {
        // (+ 0: an integer's zero has no sign)
        x.round_ties_even().clamp(-127.0, 127.0) + 0.0
    }
    #[inline(always)]
    fn decode(self) -> f32 {
        self.0 as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode8(p: *const Self) -> std::arch::x86_64::__m256 {
        load8_i8(p as *const u8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode16(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
        decode16_i8(codes)
    }
}

impl Quantized for Fp8E4M3 {
    const MAX: f32 = 448.0;
    #[inline]
    fn code(x: f32) -> Self {
        Fp8E4M3(f32_to_fp8::<3>(x.clamp(-Self::MAX, Self::MAX), 7))
    }
    #[inline(always)]
    fn rounded(x: f32) -> f32 {
        fp8_rounded::<3>(x.clamp(-Self::MAX, Self::MAX), 7)
    }
    #[inline(always)]
    fn decode(self) -> f32 {
        fp8_to_f32::<20>(self.0, E4M3_POW)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode8(p: *const Self) -> std::arch::x86_64::__m256 {
        load8_e4m3(p as *const u8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode16(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
        decode16_e4m3(codes)
    }
    const LIFT: f32 = E4M3_POW;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode16_lifted(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
        decode16_e4m3_lifted(codes)
    }
}

impl Quantized for Fp8E5M2 {
    const MAX: f32 = 57344.0;
    #[inline]
    fn code(x: f32) -> Self {
        Fp8E5M2(f32_to_fp8::<2>(x.clamp(-Self::MAX, Self::MAX), 15))
    }
    #[inline(always)]
    fn rounded(x: f32) -> f32 {
        fp8_rounded::<2>(x.clamp(-Self::MAX, Self::MAX), 15)
    }
    #[inline(always)]
    fn decode(self) -> f32 {
        fp8_to_f32::<21>(self.0, E5M2_POW)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode8(p: *const Self) -> std::arch::x86_64::__m256 {
        load8_e5m2(p as *const u8)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode16(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
        decode16_e5m2(codes)
    }
    const LIFT: f32 = E5M2_POW;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn decode16_lifted(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
        decode16_e5m2_lifted(codes)
    }
}

impl<Q: Quantized> KvElem for Q {
    const EXTRA: usize = SCALE_BYTES;
    const WIDEN: bool = true;
    const ROTATED: bool = true;
    #[inline(always)]
    fn raw(self) -> f32 {
        self.decode()
    }
    #[inline(always)]
    unsafe fn factor(row: *const Self, d: usize) -> f32 {
        Self::byte_factor(*(row.add(d) as *const u8))
    }
    #[inline(always)]
    fn byte_factor(byte: u8) -> f32 {
        bound_of(byte) * Q::RCP * Q::LANE_FACTOR
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn byte_factor16(bytes: std::arch::x86_64::__m512i) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let bound = bounds16(bytes);
        _mm512_mul_ps(
            _mm512_mul_ps(bound, _mm512_set1_ps(Q::RCP)),
            _mm512_set1_ps(Q::LANE_FACTOR),
        )
    }
    #[inline(always)]
    unsafe fn scale(row: *const Self, d: usize) -> f32 {
        bound_of(*(row.add(d) as *const u8)) * Q::RCP
    }
    /// `xs` as they are: the caller rotated them (`store_kv`), the codes are of what it gives.
    fn encode(xs: &[f32], row: &mut [Self]) {
        let d = xs.len();
        let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let byte = byte_of(amax);
        let scale = bound_of(byte) * Q::RCP;
        let (values, tail) = row.split_at_mut(d);
        for (q, x) in values.iter_mut().zip(xs) {
            *q = Q::code(x / scale);
        }
        // the row's last byte (callers give rows of d + EXTRA one-byte elements)
        assert_eq!(
            std::mem::size_of_val(tail),
            SCALE_BYTES,
            "a row's scale takes 1 byte"
        );
        // SAFETY: `tail` is exactly the byte written
        unsafe { *(tail.as_mut_ptr() as *mut u8) = byte };
    }
    fn encode_fed(xs: &[f32], row: &mut [Self], feedback: &[f32]) {
        let d = xs.len();
        assert_eq!(feedback.len(), d * d, "a row's feedback is [d, d]");
        let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let (values, tail) = row.split_at_mut(d);
        // a zero diagonal weighs every candidate's error 0: the first byte, searched or not
        let byte = if Q::SEARCH && (0..d).any(|j| feedback[j * d + j] != 0.0) {
            encode_fed_n::<Q, KEY_BYTES>(xs, values, feedback, byte_of(amax))
        } else {
            encode_fed_n::<Q, 1>(xs, values, feedback, byte_of(amax))
        };
        assert_eq!(
            std::mem::size_of_val(tail),
            SCALE_BYTES,
            "a row's scale takes 1 byte"
        );
        // SAFETY: `tail` is exactly the byte written
        unsafe { *(tail.as_mut_ptr() as *mut u8) = byte };
    }
    #[inline(always)]
    fn dot<const F: bool>(xs: &[f32], row: &[Self]) -> f32 {
        let d = xs.len();
        // SAFETY: `row` holds the row's d values and its scale
        let factor = unsafe { Self::scale(row.as_ptr(), d) };
        let mut acc = [0.0f32; 8];
        for (i, (x, q)) in xs.iter().zip(&row[..d]).enumerate() {
            acc[i % 8] += x * q.decode();
        }
        acc.iter().sum::<f32>() * factor
    }
    #[inline(always)]
    fn axpy<const F: bool>(y: &mut [f32], a: f32, row: &[Self]) {
        let d = y.len();
        // SAFETY: as in `dot`
        let a = a * unsafe { Self::scale(row.as_ptr(), d) };
        for (yi, q) in y.iter_mut().zip(&row[..d]) {
            *yi += a * q.decode();
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        Q::decode8(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        Q::decode16(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8x2(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        Q::decode16(bytes8x2(lo as *const u8, hi as *const u8))
    }
    const LIFT: f32 = Q::LIFT;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_lifted(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        Q::decode16_lifted(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8x2_lifted(lo: *const Self, hi: *const Self) -> std::arch::x86_64::__m512 {
        Q::decode16_lifted(bytes8x2(lo as *const u8, hi as *const u8))
    }
}

/// 2^120 and 2^112: an fp8 code's exponent and mantissa bits shifted into an f32's, times this,
/// is the fp8 value exactly (subnormals included: the f32 bits read as a subnormal then).
const E4M3_POW: f32 = f32::from_bits((127 + 120) << 23);
const E5M2_POW: f32 = f32::from_bits((127 + 112) << 23);

/// An fp8 code's value: `SHIFT` places its 7 magnitude bits at the top of an f32's exponent
/// and mantissa (20 for e4m3, 21 for e5m2), `pow` rebiases the exponent.
#[inline(always)]
fn fp8_to_f32<const SHIFT: u32>(b: u8, pow: f32) -> f32 {
    let magnitude = f32::from_bits(((b & 0x7f) as u32) << SHIFT) * pow;
    if b & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// `x` (finite, |x| <= the format's max) as fp8 with `M` mantissa bits and exponent `bias`,
/// rounded to nearest, ties to even; subnormals below the smallest normal.
fn f32_to_fp8<const M: u32>(x: f32, bias: i32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let min_normal = 2f32.powi(1 - bias);
    if a < min_normal {
        // multiples of the subnormal step 2^(1 - bias - M): exact scaling, then RNE (a result
        // of 2^M is the smallest normal's code, which is what it is)
        let steps = (a * 2f32.powi(bias - 1 + M as i32)).round_ties_even() as u32;
        return sign | steps as u8;
    }
    let bits = a.to_bits();
    let shift = 23 - M;
    let rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1);
    let exponent = (rounded >> 23) as i32 - 127 + bias;
    let mantissa = (rounded >> shift) & ((1 << M) - 1);
    sign | (((exponent as u32) << M) | mantissa) as u8
}

/// The value of `f32_to_fp8::<M>(x, bias)`'s code (the same rounding, sign and zero's sign
/// included), as f32.
#[inline(always)]
fn fp8_rounded<const M: u32>(x: f32, bias: i32) -> f32 {
    let a = x.abs();
    let value = if a < 2f32.powi(1 - bias) {
        let step = 2f32.powi(bias - 1 + M as i32);
        (a * step).round_ties_even() * (1.0 / step)
    } else {
        let (bits, shift) = (a.to_bits(), 23 - M);
        let rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1);
        f32::from_bits(rounded & !((1 << shift) - 1))
    };
    value.copysign(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load8_i8(p: *const u8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let bytes = _mm_loadl_epi64(p as *const __m128i);
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
}

/// Eight e4m3 codes as f32 lanes, exactly their values, in registers without a table: each
/// code sign-extended to 32 bits and shifted left by 20 puts its sign at the f32's sign (bit 31)
/// and its exponent and mantissa at the bottom of the f32's exponent and the top of its mantissa;
/// the mask clears the sign extension's copies (bits 27-30). The f32 read from those bits is the
/// value times 2^-120 (the biases differ by 120; an e4m3 subnormal is an f32 subnormal, zero is
/// zero), so one multiply by 2^120 makes it exact. (The NaN codes, which the store never writes,
/// read as ±480.) Fewer operations than through half precision (`vcvtph2ps` is two).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load8_e4m3(p: *const u8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let bits = _mm256_and_si256(
        _mm256_slli_epi32::<20>(wide),
        _mm256_set1_epi32(0x87f0_0000u32 as i32),
    );
    _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(E4M3_POW))
}

/// The eight bytes at `lo`, then the eight at `hi`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn bytes8x2(lo: *const u8, hi: *const u8) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    let low = _mm_castsi128_pd(_mm_loadl_epi64(lo as *const __m128i));
    _mm_castpd_si128(_mm_loadh_pd(low, hi as *const f64))
}

/// `load8_i8`, `load8_e4m3` and `load8_e5m2` on sixteen codes, the same operations lane by lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn decode16_i8(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn decode16_e4m3(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let bits = _mm512_and_si512(
        _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(codes)),
        _mm512_set1_epi32(0x87f0_0000u32 as i32),
    );
    _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(E4M3_POW))
}

/// `decode16_e4m3` without its multiply: each lane the value times 2^-120, exactly (an e4m3
/// subnormal an f32 subnormal).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn decode16_e4m3_lifted(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let bits = _mm512_and_si512(
        _mm512_slli_epi32::<20>(_mm512_cvtepi8_epi32(codes)),
        _mm512_set1_epi32(0x87f0_0000u32 as i32),
    );
    _mm512_castsi512_ps(bits)
}

/// Sixteen e5m2 codes as f32 lanes short of their values by 2^112, exactly: `decode16_e4m3_lifted`
/// with the code's 7 magnitude bits shifted to f32 bits 21-27 (e5m2's exponent is f32's low
/// five exponent bits; biases 15 and 127 differ by 112; a subnormal code an f32 subnormal). One
/// operation fewer than through half precision (`vcvtph2ps` on 16 lanes is two).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn decode16_e5m2_lifted(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let bits = _mm512_and_si512(
        _mm512_slli_epi32::<21>(_mm512_cvtepi8_epi32(codes)),
        _mm512_set1_epi32(0x8fe0_0000u32 as i32),
    );
    _mm512_castsi512_ps(bits)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn decode16_e5m2(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_cvtph_ps(_mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(codes)))
}

/// Eight e5m2 codes as f32 lanes: an e5m2 code is the high byte of its value's half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8_e5m2(p: *const u8) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
    _mm256_cvtph_ps(_mm_slli_epi16::<8>(wide))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<Q: KvElem>(xs: &[f32]) -> Vec<f32> {
        let mut row = vec![unsafe { std::mem::zeroed::<Q>() }; xs.len() + Q::EXTRA];
        Q::encode(xs, &mut row);
        let factor = unsafe { Q::scale(row.as_ptr(), xs.len()) };
        row[..xs.len()].iter().map(|q| q.raw() * factor).collect()
    }

    fn sample(d: usize) -> Vec<f32> {
        (0..d)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173 + (i as f32 * 0.61).sin())
            .collect()
    }

    fn encoded<Q: KvElem>(xs: &[f32], feedback: Option<&[f32]>) -> Vec<Q> {
        let mut row = vec![unsafe { std::mem::zeroed::<Q>() }; xs.len() + Q::EXTRA];
        match feedback {
            Some(f) => Q::encode_fed(xs, &mut row, f),
            None => Q::encode(xs, &mut row),
        }
        row
    }

    #[test]
    fn a_zero_feedback_codes_as_nearest_rounding() {
        let mut xs = sample(64);
        hadamard(&mut xs);
        let zero = vec![0.0f32; 64 * 64];
        assert_eq!(encoded::<I8>(&xs, Some(&zero)), encoded::<I8>(&xs, None));
        assert_eq!(
            encoded::<Fp8E4M3>(&xs, Some(&zero)),
            encoded::<Fp8E4M3>(&xs, None)
        );
    }

    #[test]
    fn feedback_moves_the_later_codes_by_the_earlier_errors() {
        // one channel's error fed wholly into the next: their sum is coded nearly exactly
        let xs = [10.3f32, 20.4, 0.0, 0.0];
        let mut f = vec![0.0f32; 16];
        f[1] = 1.0; // row 0 -> channel 1
        let fed = encoded::<I8>(&xs, Some(&f));
        let plain = encoded::<I8>(&xs, None);
        assert_eq!(fed[0], plain[0]);
        assert_eq!(fed[4], plain[4], "same scale byte");
        let scale = bound_of(fed[4].0 as u8) * <I8 as Quantized>::RCP;
        let (w0, w1) = (xs[0] / scale, xs[1] / scale);
        let want = (w1 - (w0 - w0.round_ties_even())).round_ties_even();
        assert_eq!(fed[1].0 as f32, want);
    }

    #[test]
    fn the_key_scale_search_keeps_the_candidate_byte_of_least_weighted_error() {
        // a diagonal feedback (weights, no error pushed on): each candidate byte codes the row
        // by nearest rounding; the byte kept is the one of least sum_j w_j (code_j scale - x_j)^2
        let d = 64;
        let mut moved = 0;
        for seed in 0..32 {
            let mut xs = sample(d);
            xs.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x *= 1.0 + 0.37 * seed as f32 + 0.01 * ((i * seed) % 7) as f32);
            let mut f = vec![0.0f32; d * d];
            (0..d).for_each(|j| f[j * d + j] = 0.5 + ((j * 13 + seed) % 11) as f32 / 10.0);
            let first = encoded::<Fp8E4M3>(&xs, None)[d].0;
            let chosen = encoded::<Fp8E4M3>(&xs, Some(&f))[d].0;
            let error = |byte: u8| {
                let scale = bound_of(byte) * <Fp8E4M3 as Quantized>::RCP;
                (0..d)
                    .map(|j| {
                        let e = Fp8E4M3::code(xs[j] / scale).decode() * scale;
                        f64::from(f[j * d + j]) * f64::from(e - xs[j]).powi(2)
                    })
                    .sum::<f64>()
            };
            let least = (0..KEY_BYTES as u8)
                .map(|k| error(first + k))
                .fold(f64::INFINITY, f64::min);
            assert!(
                chosen >= first && chosen < first + KEY_BYTES as u8,
                "seed {seed}"
            );
            assert!(error(chosen) <= least * (1.0 + 1e-5), "seed {seed}");
            moved += usize::from(chosen != first);
            // int8 keeps the first byte
            assert_eq!(encoded::<I8>(&xs, Some(&f))[d], encoded::<I8>(&xs, None)[d]);
        }
        assert!(
            moved >= 4,
            "a search that never moves tests nothing: {moved}"
        );
    }

    #[test]
    fn int8_round_trip_is_within_half_a_step() {
        let xs = sample(64);
        let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        // the step: the bound (amax rounded up to 5 mantissa bits, < 1.03125 amax) / 127
        assert!(amax >= bound_of(16), "in the band");
        for (x, y) in xs.iter().zip(round_trip::<I8>(&xs)) {
            assert!((x - y).abs() <= 1.03125 * amax / 127.0 * 0.5, "{x} -> {y}");
        }
    }

    #[test]
    fn the_scale_byte_is_the_smallest_bound_at_least_amax() {
        for amax in [
            0.008f32, 0.05, 0.5001, 0.77, 1.0, 1.97, 2.01, 7.99, 100.0, 251.0, 255.9, 300.0, 959.0,
            3000.0, 40000.0,
        ] {
            let byte = byte_of(amax);
            assert!(bound_of(byte) >= amax, "{amax}");
            assert!(bound_of(byte - 1) < amax, "{amax}");
        }
        assert!(BOUNDS.windows(2).all(|w| w[0] < w[1]));
        // the band: 5 mantissa bits; either side: 1
        assert_eq!(bound_of(byte_of(4.0)), 4.0);
        assert_eq!(bound_of(byte_of(4.01)), 4.125);
        assert_eq!(bound_of(byte_of(1.01)), 1.5);
        assert_eq!(bound_of(byte_of(300.0)), 384.0);
        assert_eq!(
            (bound_of(15), bound_of(16), bound_of(239), bound_of(240)),
            (1.5, 2.0, 252.0, 256.0)
        );
        // out of range: the smallest and the largest bound
        assert_eq!(
            (byte_of(0.0), byte_of(1e-9), byte_of(2f32.powi(-7))),
            (0, 0, 0)
        );
        assert_eq!(bound_of(0), 2f32.powi(-7));
        assert_eq!((byte_of(1e9), bound_of(255)), (255, 49152.0));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sixteen_lane_byte_factors_are_the_scalar_ones() {
        use crate::cpu::isa::{level, IsaLevel};
        use std::arch::x86_64::*;
        if level() < IsaLevel::Avx512 {
            return;
        }
        fn check<Q: KvElem>() {
            for first in (0..256).step_by(16) {
                let bytes: [i32; 16] = std::array::from_fn(|l| first + l as i32);
                let mut got = [0.0f32; 16];
                unsafe {
                    let v = _mm512_loadu_si512(bytes.as_ptr() as *const __m512i);
                    _mm512_storeu_ps(got.as_mut_ptr(), Q::byte_factor16(v));
                }
                for (g, b) in got.iter().zip(bytes) {
                    assert_eq!(g.to_bits(), Q::byte_factor(b as u8).to_bits(), "byte {b}");
                }
            }
        }
        check::<I8>();
        check::<Fp8E4M3>();
        check::<Fp8E5M2>();
        check::<f32>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sixteen_lane_hadamard_is_the_scalar_one_bit_for_bit() {
        use crate::cpu::isa::{level, IsaLevel};
        if level() < IsaLevel::Avx512 {
            return;
        }
        for n in [16, 32, 64, 128, 256] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173 + (i as f32 * 0.61).sin() * 1e3)
                .collect();
            let mut got = xs.clone();
            unsafe { hadamard16(&mut got) };
            // `hadamard` below the AVX-512 level
            let mut want = xs;
            butterflies(&mut want);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "n {n}");
        }
    }

    #[test]
    fn unrotate_undoes_hadamard_and_keeps_dot_products() {
        for d in [64, 96, 8] {
            let (xs, ys) = (sample(d), sample(d + 3)[3..].to_vec());
            let (mut hx, mut hy) = (xs.clone(), ys.clone());
            hadamard(&mut hx);
            unrotate(&mut hy);
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| a * b).sum::<f32>();
            assert!((dot(&hx, &hy) - dot(&xs, &ys)).abs() < 1e-4, "d {d}");
            unrotate(&mut hx);
            for (a, b) in hx.iter().zip(&xs) {
                assert!((a - b).abs() < 1e-5, "d {d}");
            }
        }
        // a spike spreads over its block: a key's one large channel no longer sets its step
        let mut spike = vec![0.0f32; 64];
        spike[5] = 8.0;
        hadamard(&mut spike);
        assert!(spike.iter().all(|x| x.abs() == 8.0));
    }

    #[test]
    fn fp8_round_trips_are_within_the_formats_relative_step() {
        let xs = sample(64);
        let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for (mantissa_bits, ys) in [
            (3, round_trip::<Fp8E4M3>(&xs)),
            (2, round_trip::<Fp8E5M2>(&xs)),
        ] {
            for (x, y) in xs.iter().zip(ys) {
                // half an ulp of the value, or of the smallest normal's step near zero
                let ulp = x.abs().max(amax * 2f32.powi(-6)) * 2f32.powi(-mantissa_bits);
                assert!((x - y).abs() <= 0.5 * ulp * 1.0001, "{x} -> {y}");
            }
        }
    }

    #[test]
    fn a_zero_row_codes_zeros() {
        assert_eq!(round_trip::<I8>(&[0.0; 8]), vec![0.0; 8]);
        assert_eq!(round_trip::<Fp8E4M3>(&[0.0; 8]), vec![0.0; 8]);
    }

    #[test]
    fn fp8_codes_decode_to_their_values() {
        // e4m3fn: 0x38 = 1.0, 0x7e = 448, 0x01 = 2^-9 (smallest subnormal), 0xb8 = -1.0
        assert_eq!(Fp8E4M3(0x38).raw(), 1.0);
        assert_eq!(Fp8E4M3(0x7e).raw(), 448.0);
        assert_eq!(Fp8E4M3(0x01).raw(), 2f32.powi(-9));
        assert_eq!(Fp8E4M3(0xb8).raw(), -1.0);
        // e5m2: 0x3c = 1.0, 0x7b = 57344, 0x01 = 2^-16
        assert_eq!(Fp8E5M2(0x3c).raw(), 1.0);
        assert_eq!(Fp8E5M2(0x7b).raw(), 57344.0);
        assert_eq!(Fp8E5M2(0x01).raw(), 2f32.powi(-16));
        for b in 0..=0x7e_u8 {
            assert_eq!(f32_to_fp8::<3>(Fp8E4M3(b).raw(), 7), b);
        }
        for b in 0..=0x7b_u8 {
            assert_eq!(f32_to_fp8::<2>(Fp8E5M2(b).raw(), 15), b);
        }
    }

    #[test]
    fn rounded_is_the_codes_value_bit_for_bit() {
        fn check<Q: Quantized>(scale: f32) {
            let mut x = 1.0f32;
            for i in 0..200_000u32 {
                // a spread of magnitudes, both signs, ties and the codes' edges included
                x = f32::from_bits(x.to_bits().wrapping_mul(2_654_435_761).rotate_left(7));
                let y = if i % 3 == 0 {
                    (i as f32 - 100_000.0) * scale / 512.0
                } else if x.is_finite() {
                    x % (2.0 * Q::MAX)
                } else {
                    -0.0
                };
                let want = Q::code(y).decode();
                assert_eq!(Q::rounded(y).to_bits(), want.to_bits(), "{y}");
            }
        }
        check::<I8>(127.0);
        check::<Fp8E4M3>(448.0);
        check::<Fp8E5M2>(57344.0);
    }

    #[test]
    fn fp8_rounds_ties_to_even() {
        // between 1.0 (0x38) and 1.125 (0x39): 1.0625 is the tie, goes to the even 0x38
        assert_eq!(f32_to_fp8::<3>(1.0625, 7), 0x38);
        assert_eq!(f32_to_fp8::<3>(1.0626, 7), 0x39);
        // between 1.125 (0x39) and 1.25 (0x3a): the tie 1.1875 goes to 0x3a
        assert_eq!(f32_to_fp8::<3>(1.1875, 7), 0x3a);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_loads_match_the_scalar_values() {
        if !crate::cpu::simd::has_avx2_fma() || !std::arch::is_x86_feature_detected!("f16c") {
            return;
        }
        fn check<Q: KvElem>(codes: &[Q]) {
            for chunk in codes.chunks_exact(8) {
                let mut got = [0.0f32; 8];
                unsafe {
                    std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), Q::load8(chunk.as_ptr()))
                };
                // a row of these codes and scale 1: the lanes times factor / scale are the values
                let mut row = chunk.to_vec();
                row.push(unsafe { std::mem::transmute_copy::<u8, Q>(&byte_of(1.0)) });
                let ratio = unsafe { Q::factor(row.as_ptr(), 8) / Q::scale(row.as_ptr(), 8) };
                let got: Vec<f32> = got.iter().map(|x| x * ratio).collect();
                let want: Vec<f32> = chunk.iter().map(|q| q.raw()).collect();
                assert_eq!(got, want);
            }
        }
        check(&(0..=255u8).map(|b| I8(b as i8)).collect::<Vec<_>>());
        // every code but the NaNs (e4m3fn: 0x7f, 0xff; e5m2: exponent all ones)
        let e4m3: Vec<_> = (0..=255u8)
            .filter(|b| b & 0x7f != 0x7f)
            .chain([0, 0])
            .map(Fp8E4M3)
            .collect();
        check(&e4m3);
        let e5m2: Vec<_> = (0..=255u8)
            .filter(|b| b & 0x7c != 0x7c)
            .map(Fp8E5M2)
            .collect();
        check(&e5m2);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sixteen_lane_loads_are_two_eight_lane_loads() {
        use crate::cpu::isa::{level, IsaLevel};
        use std::arch::x86_64::*;
        if level() < IsaLevel::Avx512 {
            return;
        }
        fn check<Q: KvElem>(codes: &[Q]) {
            let lanes8 = |p: *const Q| {
                let mut out = [0.0f32; 8];
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), Q::load8(p)) };
                out
            };
            let lanes16 = |v: __m512| {
                let mut out = [0.0f32; 16];
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
                out
            };
            for (i, chunk) in codes.chunks_exact(16).enumerate() {
                let (p, other) = (
                    chunk.as_ptr(),
                    codes[(i * 40) % (codes.len() - 8)..].as_ptr(),
                );
                let want16 = [lanes8(p), lanes8(unsafe { p.add(8) })].concat();
                assert_eq!(lanes16(unsafe { Q::load16(p) }).to_vec(), want16);
                let want_pair = [lanes8(other), lanes8(p)].concat();
                assert_eq!(lanes16(unsafe { Q::load8x2(other, p) }).to_vec(), want_pair);
                // the lifted loads: the same lanes short of a power of two, exactly
                let lift = |v: __m512| lanes16(v).map(|x| x * Q::LIFT).to_vec();
                assert_eq!(lift(unsafe { Q::load16_lifted(p) }), want16);
                assert_eq!(lift(unsafe { Q::load8x2_lifted(other, p) }), want_pair);
            }
        }
        let bytes: Vec<u8> = (0..=255u8)
            .chain(0..=255u8)
            .map(|b| b.wrapping_mul(77))
            .collect();
        check(&bytes.iter().map(|b| I8(*b as i8)).collect::<Vec<_>>());
        let e4m3: Vec<_> = bytes.iter().map(|b| Fp8E4M3(b & !0x01)).collect();
        check(&e4m3);
        let e5m2: Vec<_> = bytes.iter().map(|b| Fp8E5M2(b & !0x40)).collect();
        check(&e5m2);
        let floats: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        check(&floats);
        check(
            &floats
                .iter()
                .map(|x| Bf16::from_f32(*x))
                .collect::<Vec<_>>(),
        );
    }
}
