//! Views of an array's elements as another type of the same layout, without a copy: the
//! bindings receive numpy's element types (float32, uint16 for bfloat16's bits, int8 and uint8
//! for quantized KV codes) and the kernels take their own (`Bf16`, `I8`, `Fp8E4M3`, ...).
//!
//! The one `unsafe` cast lives here, behind [`SameLayout`]: a pair is declared once, with the
//! reason it holds, and every view built from it is safe to take.
use ndarray::{ArrayView, ArrayViewMut, Dimension};

use super::{Bf16, Fp8E4M3, Fp8E5M2, I8};

/// `Self` is laid out exactly as `T`: same size and alignment, and every bit pattern of a `T`
/// is a valid `Self` (`Self` is `T` itself or a `repr(transparent)` wrapper of it).
///
/// # Safety
/// An implementation must uphold the above: [`cast_view`] reinterprets `T` elements in place.
pub unsafe trait SameLayout<T> {}

// SAFETY: a type is laid out as itself.
unsafe impl SameLayout<f32> for f32 {}
// SAFETY: `Bf16` is a `repr(transparent)` u16 (the bfloat16 bits), valid for every u16.
unsafe impl SameLayout<u16> for Bf16 {}
// SAFETY: `I8` is a `repr(transparent)` i8 (an int8 KV code), valid for every i8.
unsafe impl SameLayout<i8> for I8 {}
// SAFETY: `Fp8E4M3` is a `repr(transparent)` u8 (the fp8 bits), valid for every u8.
unsafe impl SameLayout<u8> for Fp8E4M3 {}
// SAFETY: `Fp8E5M2` is a `repr(transparent)` u8 (the fp8 bits), valid for every u8.
unsafe impl SameLayout<u8> for Fp8E5M2 {}

/// `a`'s elements as `U`, sharing its memory and its borrow.
pub fn cast_view<'a, T, U: SameLayout<T>, D: Dimension>(
    a: ArrayView<'a, T, D>,
) -> ArrayView<'a, U, D> {
    // SAFETY: `U: SameLayout<T>`: every element pointer of the view stays valid and aligned for
    // a `U` and points at a valid `U`, for the borrow's lifetime (`cast` asserts the size).
    unsafe { a.raw_view().cast::<U>().deref_into_view() }
}

/// As [`cast_view`], mutably: the exclusive borrow moves into the returned view (and a `U`
/// written is a valid `T`, the layouts being the same both ways).
pub fn cast_view_mut<'a, T, U: SameLayout<T>, D: Dimension>(
    mut a: ArrayViewMut<'a, T, D>,
) -> ArrayViewMut<'a, U, D> {
    // SAFETY: as in `cast_view`; `a` is consumed, so the returned view is the only access.
    unsafe { a.raw_view_mut().cast::<U>().deref_into_view_mut() }
}

#[cfg(test)]
mod tests {
    use ndarray::{arr1, Array2};

    use super::*;

    #[test]
    fn a_bf16_view_reads_the_uint16_bits_in_place() {
        let bits = arr1(&[0x3f80u16, 0xc000]);
        let view: ArrayView<'_, Bf16, _> = cast_view(bits.view());
        assert_eq!(
            view.iter().map(|b| b.0).collect::<Vec<_>>(),
            [0x3f80, 0xc000]
        );
        assert_eq!(view.as_ptr() as usize, bits.as_ptr() as usize);
    }

    #[test]
    fn a_mutable_view_writes_through_with_its_strides() {
        let mut codes = Array2::<i8>::zeros((2, 3));
        {
            let mut view: ArrayViewMut<'_, I8, _> = cast_view_mut(codes.view_mut().reversed_axes());
            view[[2, 1]] = I8(-5);
        }
        assert_eq!(codes[[1, 2]], -5);
    }
}
