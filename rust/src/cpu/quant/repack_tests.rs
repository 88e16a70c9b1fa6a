//! Repacked Q4_0, Q5_0, Q8_0 and Q4_1 rows (`repack`, `QType::Q4_0R`, `Q5_0R`, `Q8_0R`,
//! `Q4_1R`) against the same rows as stored: the same values, the same products bit for bit on
//! every path (the VNNI products at AVX-512, the integer panels, the paths that read them back
//! as the plain type elsewhere), and close to the dequantized weight's product.
use ndarray::Array2;

use super::repack::{blocks, repack, standard_row};
use super::tests::{floats, random_rows};
use super::*;

/// Row lengths with a last group of 8, 2 (SmolLM2's 576), 3 and 5 blocks, and one of 1 block.
const KS: [usize; 5] = [256, 576, 96, 1696, 32];

/// The plain types with a repacked layout, each with it.
const TYPES: [(QType, QType); 4] = [
    (QType::Q4_0, QType::Q4_0R),
    (QType::Q5_0, QType::Q5_0R),
    (QType::Q8_0, QType::Q8_0R),
    (QType::Q4_1, QType::Q4_1R),
];

/// `rows` random rows of plain type `t` (`k` elements) and the same rows repacked.
fn rows_and_repacked(t: QType, rows: usize, k: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let plain = random_rows(t, rows, k, seed);
    let mut repacked = vec![0u8; plain.len()];
    repack(t, &plain, &mut repacked, k).unwrap();
    (plain, repacked)
}

fn matrix(t: QType, data: &[u8], rows: usize, k: usize) -> QuantMatrix<'_> {
    QuantMatrix::new(
        vec![Segment {
            qtype: t,
            data,
            rows,
        }],
        k,
    )
    .unwrap()
}

#[test]
fn repacked_rows_read_back_as_the_plain_rows() {
    for ((t, rt), k) in TYPES.into_iter().flat_map(|t| KS.map(|k| (t, k))) {
        let (plain, repacked) = rows_and_repacked(t, 3, k, k as u64);
        if k > 32 {
            assert_ne!(plain, repacked, "{t:?} k {k}: the layout differs");
        }
        let row = plain.len() / 3;
        let mut buf = Vec::new();
        for i in 0..3 {
            let (back_t, back) = standard_row(rt, &repacked[i * row..(i + 1) * row], &mut buf);
            assert_eq!(
                (back_t, back),
                (t, &plain[i * row..(i + 1) * row]),
                "{t:?} k {k}"
            );
        }
        let mut whole = vec![0u8; row];
        blocks(rt, &repacked[..row], &mut whole);
        assert_eq!(whole, plain[..row]);
    }
}

#[test]
fn repacked_rows_dequantize_and_embed_as_the_plain_rows() {
    for ((t, rt), k) in TYPES.into_iter().flat_map(|t| KS.map(|k| (t, k))) {
        let (plain, repacked) = rows_and_repacked(t, 5, k, 7 + k as u64);
        let (a, b) = (matrix(t, &plain, 5, k), matrix(rt, &repacked, 5, k));
        let (mut da, mut db) = (Array2::zeros((5, k)), Array2::zeros((5, k)));
        dequantize(&a, da.view_mut()).unwrap();
        dequantize(&b, db.view_mut()).unwrap();
        assert!(
            da.iter().zip(&db).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{t:?} k {k}"
        );
        let ids = [4, 0, 2];
        let (mut ea, mut eb) = (Array2::zeros((3, k)), Array2::zeros((3, k)));
        embedding(&a, &ids, ea.view_mut()).unwrap();
        embedding(&b, &ids, eb.view_mut()).unwrap();
        assert!(
            ea.iter().zip(&eb).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{t:?} k {k}"
        );
    }
}

#[test]
fn repacked_products_equal_the_plain_products_bit_for_bit_on_every_path() {
    // 13 rows: three passes of four and one row alone; x rows 1 (four rows a pass), 2-8
    // (decode rows: four repacked rows a pass, two rows of x at a time and one alone), 20
    // (integer panels / f32 panels)
    let n = 13;
    for ((t, rt), k) in TYPES.into_iter().flat_map(|t| KS.map(|k| (t, k))) {
        let (plain, repacked) = rows_and_repacked(t, n, k, 31 + k as u64);
        let (a, b) = (matrix(t, &plain, n, k), matrix(rt, &repacked, n, k));
        let bias = floats(n, 1.0);
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 20] {
            let x = Array2::from_shape_vec((m, k), floats(m * k, m as f32 + 0.5)).unwrap();
            for act in [Activations::Int16, Activations::Int8, Activations::F32] {
                for threads in [1, 2] {
                    let mut ya = Array2::from_elem((m, n), f32::NAN);
                    let mut yb = Array2::from_elem((m, n), f32::NAN);
                    quant_linear_with(x.view(), &a, Some(&bias), ya.view_mut(), threads, act)
                        .unwrap();
                    quant_linear_with(x.view(), &b, Some(&bias), yb.view_mut(), threads, act)
                        .unwrap();
                    let same = ya.iter().zip(&yb).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same, "{t:?} k {k}, m {m}, {act:?}: {ya:?} vs {yb:?}");
                }
            }
        }
    }
}

#[test]
fn integer_panels_widen_repacked_rows_in_place_as_the_plain_rows_bit_for_bit() {
    // `gemm16::Panel::pack` reads the repacked groups directly (portable and AVX2): a panel of
    // them gives the plain rows' products; a mixed panel (mins, Q6_K's halves) too
    use super::gemm16::Panel;
    use crate::cpu::linear::PANEL;
    let m = 11;
    for ((t, rt), k) in TYPES.into_iter().flat_map(|t| KS.map(|k| (t, k))) {
        let x = floats(m * k, 3.0);
        let xq = int16::QuantizedRows::new(&x, k, false);
        let bytes = t.row_bytes(k).unwrap();
        let (plain, repacked) = rows_and_repacked(t, 13, k, 41 + k as u64);
        let q4_1 = random_rows(QType::Q4_1, 1, k, 3);
        let q6_k = (k % 256 == 0).then(|| random_rows(QType::Q6_K, 1, k, 4));
        let mut a: Vec<_> = plain.chunks_exact(bytes).map(|r| (t, r)).collect();
        let mut b: Vec<_> = repacked.chunks_exact(bytes).map(|r| (rt, r)).collect();
        for rows in [&mut a, &mut b] {
            rows.push((QType::Q4_1, &q4_1[..]));
            if let Some(q6_k) = &q6_k {
                rows.push((QType::Q6_K, &q6_k[..]));
            }
        }
        for fast in [false, super::fast()] {
            for count in [1, 13, a.len()] {
                let (mut pa, mut pb) = (Panel::default(), Panel::default());
                pa.pack(&a[..count], k, fast);
                pb.pack(&b[..count], k, fast);
                let (mut ya, mut yb) = (vec![[f32::NAN; PANEL]; m], vec![[f32::NAN; PANEL]; m]);
                pa.product(&xq, &mut ya, fast);
                pb.product(&xq, &mut yb, fast);
                let bits = |s: &Vec<[f32; PANEL]>| -> Vec<u32> {
                    s.iter().flatten().map(|v| v.to_bits()).collect()
                };
                assert_eq!(
                    bits(&ya),
                    bits(&yb),
                    "{t:?} k {k}, {count} rows, fast={fast}"
                );
            }
        }
    }
}

#[test]
fn repacked_products_are_close_to_the_dequantized_product_in_a_mixed_weight() {
    // Q4_0R and Q5_0R segments between others (a fused projection), one row and four
    let k = 576;
    let (_, q4_0r) = rows_and_repacked(QType::Q4_0, 9, k, 5);
    let (_, q5_0r) = rows_and_repacked(QType::Q5_0, 5, k, 9);
    let q8_0 = random_rows(QType::Q8_0, 3, k, 6);
    let q4_1 = random_rows(QType::Q4_1, 6, k, 8);
    let segment = |qtype, data, rows| Segment { qtype, data, rows };
    let segments = vec![
        segment(QType::Q8_0, &q8_0[..], 3),
        segment(QType::Q4_0R, &q4_0r[..], 9),
        segment(QType::Q5_0R, &q5_0r[..], 5),
        segment(QType::Q4_1, &q4_1[..], 6),
    ];
    let w = QuantMatrix::new(segments, k).unwrap();
    let n = w.n();
    let mut dense = Array2::zeros((n, k));
    dequantize(&w, dense.view_mut()).unwrap();
    for m in [1, 4] {
        let x = Array2::from_shape_vec((m, k), floats(m * k, 2.0)).unwrap();
        let mut out = Array2::from_elem((m, n), f32::NAN);
        quant_linear_with(x.view(), &w, None, out.view_mut(), 1, Activations::Int16).unwrap();
        for r in 0..m {
            for c in 0..n {
                let want: f64 = (0..k)
                    .map(|i| f64::from(x[[r, i]]) * f64::from(dense[[c, i]]))
                    .sum();
                let tol = 1e-4 * (1.0 + want.abs()) * (k as f64).sqrt();
                assert!((f64::from(out[[r, c]]) - want).abs() < tol, "{r},{c}");
            }
        }
    }
}

#[test]
fn repacking_rejects_sizes_that_are_not_whole_rows() {
    for (t, block) in [(QType::Q4_0, 18), (QType::Q5_0, 22)] {
        let src = vec![0u8; 18 * block];
        let mut short = vec![0u8; 17 * block];
        let err = repack(t, &src, &mut short, 576).unwrap_err().to_string();
        assert!(err.contains("same whole rows"), "{err}");
        let mut dst = vec![0u8; 18 * block];
        assert!(repack(t, &src, &mut dst, 100).is_err());
    }
}

#[test]
fn repacking_rejects_a_type_without_a_repacked_layout() {
    let src = vec![0u8; 24 * 18];
    let mut dst = vec![0u8; src.len()];
    let err = repack(QType::Q5_1, &src, &mut dst, 576)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no repacked layout"), "{err}");
}
