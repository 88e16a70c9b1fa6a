//! The ggml weight types (as GGUF files store them) and their portable dequantization: each
//! row is a run of blocks, each block a few f16 scales and packed integers. The layouts are
//! those of ggml's `ggml-common.h`; the arithmetic is that of the `gguf` package's
//! `dequantize` (f32 products, a min subtracted or added after the product, no fused
//! multiply-add), so the portable rows here, the AVX2 rows (`formats_avx2`) and the `gguf`
//! package agree bit for bit.

use crate::cpu::invalid;
use crate::error::Result;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// A ggml tensor type the kernels read, numbered as ggml (and GGUF) number them.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum QType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    BF16 = 30,
    /// Not a ggml type: Q4_0 rows repacked at load for the VNNI products (`repack`), numbered
    /// past ggml's codes.
    Q4_0R = 1002,
    /// Not a ggml type: Q5_0 rows repacked at load for the VNNI products (`repack`).
    Q5_0R = 1006,
    /// Not a ggml type: Q8_0 rows repacked at load for the VNNI products (`repack`).
    Q8_0R = 1008,
    /// Not a ggml type: Q4_1 rows repacked at load for the VNNI products (`repack`).
    Q4_1R = 1003,
}

impl QType {
    pub const ALL: [QType; 15] = [
        QType::F32,
        QType::F16,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::BF16,
        QType::Q4_0R,
        QType::Q5_0R,
        QType::Q8_0R,
        QType::Q4_1R,
    ];

    /// The type of ggml code `code`, or an error naming the code.
    pub fn from_code(code: u32) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|t| *t as u32 == code)
            .ok_or_else(|| {
                invalid(format!(
                    "unsupported ggml type {code}; the quantized kernels take {}",
                    Self::ALL.map(|t| t.name()).join(", ")
                ))
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            QType::F32 => "F32",
            QType::F16 => "F16",
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q8_0 => "Q8_0",
            QType::Q4_K => "Q4_K",
            QType::Q5_K => "Q5_K",
            QType::Q6_K => "Q6_K",
            QType::BF16 => "BF16",
            QType::Q4_0R => "Q4_0 (repacked)",
            QType::Q5_0R => "Q5_0 (repacked)",
            QType::Q8_0R => "Q8_0 (repacked)",
            QType::Q4_1R => "Q4_1 (repacked)",
        }
    }

    /// (elements, bytes) of one block.
    pub fn block(self) -> (usize, usize) {
        match self {
            QType::F32 => (1, 4),
            QType::F16 | QType::BF16 => (1, 2),
            QType::Q4_0 | QType::Q4_0R => (32, 18),
            QType::Q4_1 | QType::Q4_1R => (32, 20),
            QType::Q5_0 | QType::Q5_0R => (32, 22),
            QType::Q5_1 => (32, 24),
            QType::Q8_0 | QType::Q8_0R => (32, 34),
            QType::Q4_K => (QK_K, 144),
            QType::Q5_K => (QK_K, 176),
            QType::Q6_K => (QK_K, 210),
        }
    }

    /// Bytes of a row of `k` elements; an error unless `k` is whole blocks.
    pub fn row_bytes(self, k: usize) -> Result<usize> {
        let (elems, bytes) = self.block();
        if !k.is_multiple_of(elems) {
            return Err(invalid(format!(
                "{} rows hold whole blocks of {elems} elements; {k} is not a multiple",
                self.name()
            )));
        }
        Ok(k / elems * bytes)
    }
}

/// IEEE half bits to f32 (exact).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = u32::from((h >> 10) & 0x1F);
    let man = u32::from(h & 0x3FF);
    match exp {
        // zero and subnormals: man * 2^-24, exact in f32
        0 => sign * (man as f32 * (1.0 / 16_777_216.0)),
        31 => f32::from_bits((u32::from(h & 0x8000) << 16) | 0x7F80_0000 | (man << 13)),
        _ => f32::from_bits((u32::from(h & 0x8000) << 16) | ((exp + 112) << 23) | (man << 13)),
    }
}

/// f32 to IEEE half bits, rounded to nearest, ties to even (as numpy's `astype(float16)` and
/// ggml's `GGML_FP32_TO_FP16`).
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xFF) as i32;
    let man = bits & 0x7F_FFFF;
    if exp == 0xFF {
        let nan = if man != 0 { 0x200 } else { 0 };
        return sign | 0x7C00 | nan;
    }
    let e = exp - 112; // the f16 exponent field
    if e >= 31 {
        return sign | 0x7C00;
    }
    if e <= 0 {
        // an f16 subnormal (or zero): the 24-bit significand shifted right, rounded
        if e < -10 {
            return sign;
        }
        let shift = (14 - e) as u32;
        return sign | round_shift(man | 0x80_0000, shift) as u16;
    }
    // a carry out of the significand rounds into the exponent, up to infinity: both right
    sign | (((e as u32) << 10) + round_shift(man, 13)) as u16
}

/// `v >> shift` rounded to nearest, ties to even.
#[inline(always)]
fn round_shift(v: u32, shift: u32) -> u32 {
    let q = v >> shift;
    let rest = v & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    q + u32::from(rest > half || (rest == half && q & 1 == 1))
}

#[inline(always)]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Sub-block `i`'s (scale, min) of a Q4_K / Q5_K super-block: 6 bits each, packed in 12 bytes
/// (the first four sub-blocks in the low 6 bits of bytes 0-7, the last four in the nibbles of
/// bytes 8-11 and the top 2 bits of bytes 0-7).
#[inline(always)]
pub fn k_scale_min(s: &[u8], i: usize) -> (u8, u8) {
    if i < 4 {
        (s[i] & 63, s[i + 4] & 63)
    } else {
        (
            (s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4),
            (s[i + 4] >> 4) | ((s[i] >> 6) << 4),
        )
    }
}

/// Dequantizes whole blocks `src` of type `t` into `dst` (`dst.len()` = their elements).
pub fn dequantize_blocks(t: QType, src: &[u8], dst: &mut [f32]) {
    if super::repack::repacked(t) {
        // whole groups of a repacked row (`dequantize_range`'s chunks start on one)
        let plain = super::repack::read_as(t);
        super::repack::dequantize_groups(t, src, dst, |b, y| dequantize_blocks(plain, b, y));
        return;
    }
    let (elems, bytes) = t.block();
    debug_assert_eq!(src.len() / bytes * elems, dst.len());
    for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(elems)) {
        match t {
            QType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            QType::F16 => y[0] = half_at(b, 0),
            QType::BF16 => y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
            QType::Q4_0 => q4_0(b, y),
            QType::Q4_1 => q4_1(b, y),
            QType::Q5_0 => q5_0(b, y),
            QType::Q5_1 => q5_1(b, y),
            QType::Q8_0 => q8_0(b, y),
            QType::Q4_K => q4_k(b, y),
            QType::Q5_K => q5_k(b, y),
            QType::Q6_K => q6_k(b, y),
            QType::Q4_0R | QType::Q5_0R | QType::Q8_0R | QType::Q4_1R => {
                unreachable!("repacked rows are dequantized a group at a time")
            }
        }
    }
}

/// d: f16, qs[16]: element j is the low nibble of qs[j], element j + 16 its high nibble; q - 8.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (j, q) in b[2..18].iter().enumerate() {
        y[j] = d * ((q & 0xF) as i32 - 8) as f32;
        y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
    }
}

/// d, m: f16, qs[16] as Q4_0's; d * q + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for (j, q) in b[4..20].iter().enumerate() {
        y[j] = d * (q & 0xF) as f32 + m;
        y[j + 16] = d * (q >> 4) as f32 + m;
    }
}

/// Element j's 5-bit value: Q4_0's nibble plus bit j of `qh` as bit 4.
#[inline(always)]
pub(super) fn five_bits(qs: &[u8], qh: u32, j: usize) -> u8 {
    let nibble = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
    nibble | ((((qh >> j) & 1) as u8) << 4)
}

/// d: f16, qh: u32 (bit j = element j's bit 4), qs[16]; q - 16.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, v) in y.iter_mut().enumerate() {
        *v = d * (five_bits(&b[6..22], qh, j) as i32 - 16) as f32;
    }
}

/// d, m: f16, qh: u32, qs[16]; d * q + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, v) in y.iter_mut().enumerate() {
        *v = d * five_bits(&b[8..24], qh, j) as f32 + m;
    }
}

/// d: f16, qs: i8[32]; d * q.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half_at(b, 0);
    for (v, q) in y.iter_mut().zip(&b[2..34]) {
        *v = d * (*q as i8) as f32;
    }
}

/// d, dmin: f16, scales[12] (`k_scale_min`), qs[128]: 64-element group g is qs[32g..32g + 32],
/// its low nibbles sub-block 2g, its high nibbles sub-block 2g + 1; (d * sc) * q - dmin * m.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (i, sub) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, i);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let group = &qs[32 * (i / 2)..32 * (i / 2) + 32];
        let shift = 4 * (i % 2);
        for (v, q) in sub.iter_mut().zip(group) {
            *v = dl * ((q >> shift) & 0xF) as f32 - ml;
        }
    }
}

/// Q4_K's layout with qh[32] before qs: element l of sub-block i has bit i of qh[l] as bit 4.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (i, sub) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, i);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let group = &qs[32 * (i / 2)..32 * (i / 2) + 32];
        let shift = 4 * (i % 2);
        for (l, v) in sub.iter_mut().enumerate() {
            let q = ((group[l] >> shift) & 0xF) | (((qh[l] >> i) & 1) << 4);
            *v = dl * q as f32 - ml;
        }
    }
}

/// ql[128], qh[64], scales: i8[16], d: f16. Element 128h + 32k + l (half h, quarter k):
/// low 4 bits from nibble k / 2 of ql[64h + 32(k % 2) + l], high 2 bits from bits 2k of
/// qh[32h + l]; (d * scales[e / 16]) * (q - 32).
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    for (e, v) in y.iter_mut().enumerate() {
        let (h, k, l) = (e / 128, (e / 32) % 4, e % 32);
        let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
        let high = (qh[32 * h + l] >> (2 * k)) & 3;
        let q = (low | (high << 4)) as i32 - 32;
        *v = (d * (scales[e / 16] as i8) as f32) * q as f32;
    }
}
