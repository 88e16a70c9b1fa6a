//! Float rows quantized to Q8_0 and Q4_0 (for checkpoints quantized at load), with the
//! rounding of ggml's reference quantizers (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`)
//! as the `gguf` package reproduces them, byte for byte.

use super::formats::{f32_to_f16, QType};
use crate::cpu::invalid;
use crate::error::Result;

/// Quantizes `src` (whole blocks of 32 floats) into `dst` (their blocks' bytes) as `t`.
pub fn quantize_blocks(t: QType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let block: fn(&[f32], &mut [u8]) = match t {
        QType::Q8_0 => q8_0,
        QType::Q4_0 => q4_0,
        _ => {
            return Err(invalid(format!(
                "quantizing to {} is not supported (Q8_0 and Q4_0 are)",
                t.name()
            )))
        }
    };
    let (elems, bytes) = t.block();
    if !src.len().is_multiple_of(elems) || dst.len() != src.len() / elems * bytes {
        return Err(invalid(format!(
            "{} floats do not fill {} bytes of {} blocks",
            src.len(),
            dst.len(),
            t.name()
        )));
    }
    for (x, b) in src.chunks_exact(elems).zip(dst.chunks_exact_mut(bytes)) {
        block(x, b);
    }
    Ok(())
}

/// d = max |x| / 127, q = round(x / d) (half away from zero), d stored as f16.
fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (q, v) in b[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// d = (the value of largest magnitude, sign kept) / -8, q = trunc(x / d + 8.5) clamped to 15.
/// ggml computes `x * id + 8.5` with one rounding (a fused multiply-add); the product of two
/// f32 is exact in f64, so the sum rounded once in f64 and then to f32 is what `gguf` does.
fn q4_0(x: &[f32], b: &mut [u8]) {
    let mut max = 0.0f32;
    for v in x {
        if v.abs() > max.abs() {
            max = *v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    let q = |v: f32| {
        ((f64::from(v) * f64::from(id) + 8.5) as f32)
            .trunc()
            .clamp(0.0, 15.0) as u8
    };
    for j in 0..16 {
        b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}
