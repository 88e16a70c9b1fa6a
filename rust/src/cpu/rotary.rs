//! Rotary position embedding applied in place to the q/k heads of a step (half-split,
//! "rotate_half" convention): each head's halves (a, b) become (a·cos − b·sin, b·cos + a·sin).
//!
//! torch spells this as a concatenation of the swapped halves, two products and a sum: three
//! head-sized temporaries and five ops per layer. Here every head is rotated where it sits (in
//! the fused q/k/v projection's output), with the step's cos/sin tables computed once for all
//! layers. Products and sums are rounded one at a time (no fused multiply-add), so the result is
//! bit-identical to torch's formula; in bf16 each product and sum is rounded to bf16 as well, as
//! torch's bf16 ops do (x, cos and sin share one element type, `Elem`).
use ndarray::{ArrayView2, ArrayViewMut3};

use super::elem::Elem;
use super::invalid;
#[cfg(target_arch = "x86_64")]
use super::isa::{self, IsaLevel};
use crate::error::Result;

/// Rotates `x` `[T, heads, D]` (rows and heads at any stride, each head contiguous) in place by
/// its token's angles: `cos`, `sin` `[T, D / 2]` (rows contiguous).
pub fn rotary_in_place<T: Elem>(
    mut x: ArrayViewMut3<T>,
    cos: ArrayView2<T>,
    sin: ArrayView2<T>,
) -> Result<()> {
    let (tokens, _, head_dim) = x.dim();
    if head_dim % 2 != 0 {
        return Err(invalid(format!("head_dim must be even, got {head_dim}")));
    }
    let half = head_dim / 2;
    for (name, dim) in [("cos", cos.dim()), ("sin", sin.dim())] {
        if dim != (tokens, half) {
            return Err(invalid(format!(
                "{name} must be [{tokens}, {half}] (tokens, head_dim / 2), got {dim:?}"
            )));
        }
    }
    if half > 0 && !x.is_empty() && x.strides()[2] != 1 {
        return Err(invalid("x must be contiguous within each head"));
    }
    for ((mut token, c), s) in x.outer_iter_mut().zip(cos.rows()).zip(sin.rows()) {
        let (c, s) = match (c.as_slice(), s.as_slice()) {
            (Some(c), Some(s)) => (c, s),
            _ => return Err(invalid("cos and sin rows must be contiguous")),
        };
        for mut head in token.outer_iter_mut() {
            let head = head
                .as_slice_mut()
                .expect("unit innermost stride checked above");
            rotate(head, c, s);
        }
    }
    Ok(())
}

/// `rotate_head` compiled for the process's ISA level (its loop is elementwise, with no fused
/// multiply-add: the same bits at every level, 4, 8 or 16 lanes a step).
#[inline]
fn rotate<T: Elem>(head: &mut [T], cos: &[T], sin: &[T]) {
    #[cfg(target_arch = "x86_64")]
    match isa::level() {
        // SAFETY: the CPU supports the features the functions are compiled for (the level).
        IsaLevel::Portable => {}
        IsaLevel::Avx2 => return unsafe { rotate_avx2(head, cos, sin) },
        _ => return unsafe { rotate_avx512(head, cos, sin) },
    }
    rotate_head(head, cos, sin);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rotate_avx2<T: Elem>(head: &mut [T], cos: &[T], sin: &[T]) {
    rotate_head(head, cos, sin);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn rotate_avx512<T: Elem>(head: &mut [T], cos: &[T], sin: &[T]) {
    rotate_head(head, cos, sin);
}

#[inline(always)]
fn rotate_head<T: Elem>(head: &mut [T], cos: &[T], sin: &[T]) {
    let (a, b) = head.split_at_mut(cos.len());
    for (((a, b), c), s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
        let (x1, x2, c, s) = (a.to_f32(), b.to_f32(), c.to_f32(), s.to_f32());
        *a = T::from_f32(T::round(x1 * c) - T::round(x2 * s));
        *b = T::from_f32(T::round(x2 * c) + T::round(x1 * s));
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{s, Array2, Array3};

    use super::rotary_in_place;
    use crate::cpu::elem::{Bf16, Elem};

    fn tables(tokens: usize, half: usize) -> (Array2<f32>, Array2<f32>) {
        let angle = |t: usize, i: usize| (t as f32 + 1.0) * 0.37 / (1.0 + i as f32);
        (
            Array2::from_shape_fn((tokens, half), |(t, i)| angle(t, i).cos()),
            Array2::from_shape_fn((tokens, half), |(t, i)| angle(t, i).sin()),
        )
    }

    #[test]
    fn rotates_each_half_by_its_tokens_angle() {
        let (tokens, heads, dim) = (3, 2, 4);
        let x0 = Array3::from_shape_fn((tokens, heads, dim), |(t, h, d)| {
            (t * 7 + h * 3 + d) as f32 * 0.25 - 1.0
        });
        let (cos, sin) = tables(tokens, dim / 2);
        let mut x = x0.clone();
        rotary_in_place(x.view_mut(), cos.view(), sin.view()).unwrap();
        let half = dim / 2;
        for ((t, h, d), &got) in x.indexed_iter() {
            let i = d % half;
            let (a, b) = (x0[[t, h, i]], x0[[t, h, i + half]]);
            let (c, s) = (cos[[t, i]], sin[[t, i]]);
            let want = if d < half {
                a * c - b * s
            } else {
                b * c + a * s
            };
            assert_eq!(got, want, "token {t} head {h} dim {d}");
        }
    }

    #[test]
    fn rotates_a_strided_slice_and_leaves_the_rest() {
        // q/k heads are the first columns of each fused q/k/v row; v must stay untouched
        let (tokens, heads, dim) = (4, 3, 8);
        let fused0 = Array3::from_shape_fn((tokens, heads + 1, dim), |(t, h, d)| {
            (t + h * 5 + d * 3) as f32 * 0.1
        });
        let (cos, sin) = tables(tokens, dim / 2);
        let mut fused = fused0.clone();
        let mut whole = fused0.slice(s![.., ..heads, ..]).to_owned();
        rotary_in_place(fused.slice_mut(s![.., ..heads, ..]), cos.view(), sin.view()).unwrap();
        rotary_in_place(whole.view_mut(), cos.view(), sin.view()).unwrap();
        assert_eq!(fused.slice(s![.., ..heads, ..]), whole);
        assert_eq!(
            fused.slice(s![.., heads, ..]),
            fused0.slice(s![.., heads, ..])
        );
    }

    #[test]
    fn bf16_rounds_every_product_and_sum_like_torch() {
        // torch's bf16 formula: a*c - b*s with each product and the difference rounded to bf16
        let (tokens, heads, dim) = (3, 2, 8);
        let half = dim / 2;
        let r = |x: f32| Bf16::from_f32(x);
        let x0 = Array3::from_shape_fn((tokens, heads, dim), |(t, h, d)| {
            r((t * 7 + h * 3 + d) as f32 * 0.173 - 1.1)
        });
        let (cos, sin) = tables(tokens, half);
        let (cos, sin) = (cos.mapv(r), sin.mapv(r));
        let mut x = x0.clone();
        rotary_in_place(x.view_mut(), cos.view(), sin.view()).unwrap();
        let w = |x: Bf16| x.to_f32();
        let mut rounded_differently = 0;
        for ((t, h, d), &got) in x.indexed_iter() {
            let i = d % half;
            let (a, b) = (w(x0[[t, h, i]]), w(x0[[t, h, i + half]]));
            let (c, s) = (w(cos[[t, i]]), w(sin[[t, i]]));
            let (want, unrounded) = if d < half {
                (r(w(r(a * c)) - w(r(b * s))), a * c - b * s)
            } else {
                (r(w(r(b * c)) + w(r(a * s))), b * c + a * s)
            };
            assert_eq!(got, want, "token {t} head {h} dim {d}");
            rounded_differently += (got != r(unrounded)) as usize;
        }
        // the case exercises the per-op rounding (one final rounding would differ somewhere)
        assert!(rounded_differently > 0);
    }

    #[test]
    fn rejects_mismatched_tables_and_odd_head_dims() {
        let mut x = Array3::<f32>::zeros((2, 1, 4));
        let (cos, sin) = tables(3, 2);
        assert!(rotary_in_place(x.view_mut(), cos.view(), sin.view()).is_err());
        let mut odd = Array3::<f32>::zeros((3, 1, 5));
        assert!(rotary_in_place(odd.view_mut(), cos.view(), sin.view()).is_err());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_level_gives_the_portable_bits() {
        use super::{rotate_avx2, rotate_avx512, rotate_head};
        use crate::cpu::isa::{self, IsaLevel};
        let half = 40; // two 16-lane chunks and a tail of 8
        let (cos, sin) = tables(1, half);
        let (cos, sin) = (cos.as_slice().unwrap(), sin.as_slice().unwrap());
        let x0: Vec<f32> = (0..2 * half)
            .map(|d| (d as f32 * 0.77).sin() * 3.0)
            .collect();
        let mut want = x0.clone();
        rotate_head(&mut want, cos, sin);
        let level = isa::level();
        if level >= IsaLevel::Avx2 {
            let mut got = x0.clone();
            // SAFETY: the level (checked just above) has what the function is compiled for.
            unsafe { rotate_avx2(&mut got, cos, sin) };
            assert_eq!(got, want, "avx2");
        }
        if level >= IsaLevel::Avx512 {
            let mut got = x0.clone();
            // SAFETY: as above.
            unsafe { rotate_avx512(&mut got, cos, sin) };
            assert_eq!(got, want, "avx512");
        }
    }
}
