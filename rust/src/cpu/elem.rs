//! The element types the CPU kernels read and write: `f32`, and bfloat16 as its 16 bits
//! (`Bf16`). Arithmetic is always in f32: a bf16 widens exactly (its bits are the high half of
//! an f32) and narrows by rounding to nearest, ties to even, as torch does.

/// What the kernels need of a tensor element.
pub trait Elem: Copy + Send + Sync + 'static {
    const ZERO: Self;
    /// `Self` is bfloat16: the SIMD loops load it with a widening shift instead of as f32.
    const IS_BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// `x` rounded to this type's precision and back: what a torch op in this dtype keeps of an
    /// f32 result (identity for f32).
    #[inline(always)]
    fn round(x: f32) -> f32 {
        Self::from_f32(x).to_f32()
    }
    /// The slice as f32, if that is what it holds (the kernels then accumulate in place).
    fn as_f32_mut(xs: &mut [Self]) -> Option<&mut [f32]>;
}

impl Elem for f32 {
    const ZERO: Self = 0.0;
    const IS_BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn as_f32_mut(xs: &mut [Self]) -> Option<&mut [f32]> {
        Some(xs)
    }
}

/// A bfloat16: the upper 16 bits of an f32 (sign, 8 exponent bits, 7 mantissa bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Elem for Bf16 {
    const ZERO: Self = Bf16(0);
    const IS_BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        if x.is_nan() {
            // torch's quiet NaN (a plain truncation could turn a NaN into an infinity)
            return Bf16(0x7fc0);
        }
        let bits = x.to_bits();
        // round to nearest, ties to the even upper half; no overflow: the largest non-NaN
        // pattern, 0xff80_0000 (-inf), is far from u32::MAX
        let round = 0x7fff + ((bits >> 16) & 1);
        Bf16(((bits + round) >> 16) as u16)
    }
    #[inline(always)]
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{Bf16, Elem};

    #[test]
    fn bf16_widens_exactly_and_round_trips() {
        for bits in (0..=u16::MAX).step_by(7) {
            let x = Bf16(bits);
            let wide = x.to_f32();
            if wide.is_nan() {
                assert!(Bf16::from_f32(wide).to_f32().is_nan());
            } else {
                assert_eq!(Bf16::from_f32(wide), x, "{bits:#06x}");
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_with_ties_to_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
        assert_eq!(Bf16::from_f32(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6
        assert_eq!(
            Bf16::from_f32(1.0 + 3.0 * 2f32.powi(-8)).to_f32(),
            1.0 + 2f32.powi(-6)
        );
        // just above a tie rounds up, just below rounds down
        assert_eq!(
            Bf16::from_f32(1.0 + 2f32.powi(-8) + 2f32.powi(-20)).to_f32(),
            1.0 + 2f32.powi(-7)
        );
        assert_eq!(Bf16::from_f32(-1.0 - 2f32.powi(-9)).to_f32(), -1.0);
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(f32::MAX).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(f32::NAN).0, 0x7fc0);
    }
}
