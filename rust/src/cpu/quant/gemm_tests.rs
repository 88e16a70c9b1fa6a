//! The integer panels of the multi-row products (`gemm16`) against an f64 product of the
//! weights' and x's codes, the AVX2 path against the portable one, and `quant_linear_with` at
//! batched-decode and prefill row counts against the dequantized weights.
use ndarray::Array2;

use super::formats::QType;
use super::gemm16::{takes, Panel};
use super::quantize::quantize_blocks;
use super::tests::{random_rows, QUANTIZED_TYPES};
use super::*;
use crate::cpu::linear::PANEL;

/// Pseudo-random floats in about [-1, 1) (xorshift), the same for the same seed, with a few
/// larger values so that blocks' scales differ.
fn floats(len: usize, seed: u64) -> Vec<f32> {
    let mut next = super::tests::xorshift(seed);
    (0..len)
        .map(|i| {
            let v = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 97 == 5 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

/// `n` rows of `k` random weights quantized to `t` (Q8_0 or Q4_0).
fn rows_of(t: QType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; n * t.row_bytes(k).unwrap()];
    quantize_blocks(t, &floats(n * k, seed), &mut data).unwrap();
    data
}

fn dequantized(t: QType, row: &[u8], k: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; k];
    dequantize_range(t, row, 0, &mut out, false);
    out
}

/// `Σ_b d_w · d_x · Σ q_w q_x + m_w · s_x` in f64 of a weight row and a row of x's codes (the
/// weight's codes, scales and mins as `int16`'s units give them), and the sum of the terms'
/// magnitudes (the scale of f32 rounding).
fn codes_reference(t: QType, row: &[u8], xq: int16::Row<'_>, k: usize) -> (f64, f64) {
    let (mut sum, mut size) = (0.0f64, 0.0f64);
    for b in 0..k / 32 {
        let (w, dw, mw) = int16::codes(t, row, b);
        for h in 0..2 {
            let int: i64 = w[16 * h..16 * h + 16]
                .iter()
                .zip(&xq.q[32 * b + 16 * h..32 * b + 16 * h + 16])
                .map(|(w, q)| i64::from(*w) * i64::from(*q))
                .sum();
            let term = f64::from(dw[h]) * f64::from(xq.d[b]) * int as f64;
            sum += term;
            size += term.abs();
        }
        let term = f64::from(mw) * f64::from(xq.s[b]);
        sum += term;
        size += term.abs();
    }
    (sum, size)
}

#[test]
fn panels_take_every_quantized_type() {
    let taken: Vec<QType> = QType::ALL.into_iter().filter(|t| takes(*t)).collect();
    let want = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
    ];
    assert_eq!(taken, want);
}

/// The quantized types the integer panels take.
fn panel_types() -> impl Iterator<Item = QType> {
    QUANTIZED_TYPES.into_iter().filter(|t| takes(*t))
}

#[test]
fn a_panel_product_is_the_codes_product_and_avx2_equals_portable_bit_for_bit() {
    for t in panel_types() {
        for (m, count, k) in [
            (9, 16, 256),
            (10, 7, 512),
            (11, 1, 256),
            (33, 16, 768),
            (64, 13, 256),
        ] {
            let data = random_rows(t, count, k, (m * count + k) as u64);
            let bytes = t.row_bytes(k).unwrap();
            let rows: Vec<_> = data.chunks_exact(bytes).map(|r| (t, r)).collect();
            let x = floats(m * k, m as u64 + 3);
            let xq = int16::QuantizedRows::new(&x, k, false);
            let mut portable = vec![[f32::NAN; PANEL]; m];
            let mut panel = Panel::default();
            panel.pack(&rows, k, false);
            panel.product(&xq, &mut portable, false);
            for (i, sums) in portable.iter().enumerate() {
                for (j, got) in sums.iter().enumerate() {
                    let (want, size) = rows
                        .get(j)
                        .map_or((0.0, 0.0), |(t, r)| codes_reference(*t, r, xq.row(i), k));
                    let tol = 1e-6 * size + 1e-6;
                    let name = t.name();
                    assert!(
                        (f64::from(*got) - want).abs() <= tol,
                        "{name} {m}x{k} [{i}, {j}]: {got} vs {want}"
                    );
                }
            }
            if super::fast() {
                let mut avx2 = vec![[f32::NAN; PANEL]; m];
                let mut packed = Panel::default();
                packed.pack(&rows, k, true);
                packed.product(&xq, &mut avx2, true);
                let bits = |s: &Vec<[f32; PANEL]>| -> Vec<u32> {
                    s.iter().flatten().map(|v| v.to_bits()).collect()
                };
                assert_eq!(bits(&avx2), bits(&portable), "{} {m}x{k}", t.name());
            }
        }
    }
}

#[test]
fn quant_linear_int16_multi_row_products_are_close_to_the_dequantized_product() {
    // batched-decode (9-64) and prefill (128-200) rows, output columns that end in a partial
    // panel, a weight of two types, 1 and 2 threads
    let k = 512;
    let (n8, n4, nk, n1, n6) = (21, 30, 18, 9, 7);
    let (d8, d4) = (
        rows_of(QType::Q8_0, n8, k, 1),
        rows_of(QType::Q4_0, n4, k, 2),
    );
    let (dk, d1) = (
        random_rows(QType::Q4_K, nk, k, 3),
        random_rows(QType::Q4_1, n1, k, 4),
    );
    let d6 = random_rows(QType::Q6_K, n6, k, 5);
    let segments = vec![
        Segment {
            qtype: QType::Q8_0,
            data: &d8,
            rows: n8,
        },
        Segment {
            qtype: QType::Q4_0,
            data: &d4,
            rows: n4,
        },
        Segment {
            qtype: QType::Q4_K,
            data: &dk,
            rows: nk,
        },
        Segment {
            qtype: QType::Q4_1,
            data: &d1,
            rows: n1,
        },
        Segment {
            qtype: QType::Q6_K,
            data: &d6,
            rows: n6,
        },
    ];
    let w = QuantMatrix::new(segments, k).unwrap();
    let n = w.n();
    let weights: Vec<Vec<f32>> = (0..n)
        .map(|c| {
            let (t, row) = w.row(c);
            dequantized(t, row, k)
        })
        .collect();
    let bias = floats(n, 99);
    for m in [9, 12, 17, 32, 64, 128, 200] {
        let x = Array2::from_shape_vec((m, k), floats(m * k, m as u64)).unwrap();
        for threads in [1, 2] {
            let mut out = Array2::from_elem((m, n), f32::NAN);
            let int16 = Activations::Int16;
            quant_linear_with(x.view(), &w, Some(&bias), out.view_mut(), threads, int16).unwrap();
            for i in 0..m {
                let xi = x.row(i);
                for (c, wc) in weights.iter().enumerate() {
                    let want: f64 = xi
                        .iter()
                        .zip(wc)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        + f64::from(bias[c]);
                    let scale: f64 = xi
                        .iter()
                        .zip(wc)
                        .map(|(a, b)| f64::from((a * b).abs()))
                        .sum();
                    // 16-bit codes of x: an error of at most max|x| / 65534 per element
                    let tol = 1e-3 * scale + 1e-5;
                    let got = f64::from(out[[i, c]]);
                    assert!(
                        (got - want).abs() <= tol,
                        "m {m} [{i}, {c}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn quant_linear_int16_multi_row_results_do_not_depend_on_threads() {
    let k = 256;
    let n = 70;
    let data = rows_of(QType::Q8_0, n, k, 5);
    let w = QuantMatrix::new(
        vec![Segment {
            qtype: QType::Q8_0,
            data: &data,
            rows: n,
        }],
        k,
    )
    .unwrap();
    let m = 40;
    let x = Array2::from_shape_vec((m, k), floats(m * k, 8)).unwrap();
    let run = |threads| {
        let mut out = Array2::from_elem((m, n), f32::NAN);
        quant_linear_with(
            x.view(),
            &w,
            None,
            out.view_mut(),
            threads,
            Activations::Int16,
        )
        .unwrap();
        out
    };
    let one = run(1);
    assert!(one.iter().all(|v| v.is_finite()));
    assert_eq!(run(2), one);
}

#[test]
fn quant_linear_int16_leaves_weights_with_other_types_on_the_float_panels() {
    // an F16 segment: the whole call keeps the f32 panels, bit for bit F32's result
    let k = 256;
    let (d8, dk) = (
        rows_of(QType::Q8_0, 5, k, 3),
        random_rows(QType::F16, 4, k, 4),
    );
    let segments = vec![
        Segment {
            qtype: QType::Q8_0,
            data: &d8,
            rows: 5,
        },
        Segment {
            qtype: QType::F16,
            data: &dk,
            rows: 4,
        },
    ];
    let w = QuantMatrix::new(segments, k).unwrap();
    let m = 12;
    let x = Array2::from_shape_vec((m, k), floats(m * k, 4)).unwrap();
    let mut f32_out = Array2::zeros((m, 9));
    let mut int16_out = Array2::zeros((m, 9));
    quant_linear_with(x.view(), &w, None, f32_out.view_mut(), 1, Activations::F32).unwrap();
    quant_linear_with(
        x.view(),
        &w,
        None,
        int16_out.view_mut(),
        1,
        Activations::Int16,
    )
    .unwrap();
    assert_eq!(int16_out, f32_out);
}

#[test]
fn quant_linear_int16_multi_row_products_keep_a_nan_of_x() {
    let (m, k, n) = (10, 64, 16);
    let data = rows_of(QType::Q4_0, n, k, 6);
    let w = QuantMatrix::new(
        vec![Segment {
            qtype: QType::Q4_0,
            data: &data,
            rows: n,
        }],
        k,
    )
    .unwrap();
    let mut x = floats(m * k, 9);
    x[3 * k + 33] = f32::NAN;
    let x = Array2::from_shape_vec((m, k), x).unwrap();
    let mut out = Array2::zeros((m, n));
    quant_linear_with(x.view(), &w, None, out.view_mut(), 1, Activations::Int16).unwrap();
    for i in 0..m {
        for c in 0..n {
            assert_eq!(out[[i, c]].is_nan(), i == 3, "[{i}, {c}]");
        }
    }
}

#[test]
fn a_panel_packed_again_with_fewer_rows_equals_a_fresh_panel_bit_for_bit() {
    // the staging rows are zeroed only where a row is missing: a full panel's rows must not
    // leak into a later, shorter one
    let (m, k) = (12, 512);
    let x = floats(m * k, 17);
    let xq = int16::QuantizedRows::new(&x, k, false);
    for t in panel_types() {
        let bytes = t.row_bytes(k).unwrap();
        let full = random_rows(t, PANEL, k, 5);
        let short = random_rows(t, 7, k, 6);
        let (full, short): (Vec<_>, Vec<_>) = (
            full.chunks_exact(bytes).map(|r| (t, r)).collect(),
            short.chunks_exact(bytes).map(|r| (t, r)).collect(),
        );
        for fast in [false, super::fast()] {
            let mut reused = Panel::default();
            reused.pack(&full, k, fast);
            reused.pack(&short, k, fast);
            let mut fresh = Panel::default();
            fresh.pack(&short, k, fast);
            let (mut a, mut b) = (vec![[f32::NAN; PANEL]; m], vec![[f32::NAN; PANEL]; m]);
            reused.product(&xq, &mut a, fast);
            fresh.product(&xq, &mut b, fast);
            let bits = |s: &Vec<[f32; PANEL]>| -> Vec<u32> {
                s.iter().flatten().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&a), bits(&b), "{} fast={fast}", t.name());
        }
    }
}
