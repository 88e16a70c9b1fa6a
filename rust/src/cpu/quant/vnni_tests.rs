//! The AVX-512 VNNI products (`vnni`, `gemm16`'s VNNI tile) against the portable and AVX2 ones:
//! the same bits. Each test returns at once where the process does not run at AVX-512 with
//! VNNI (`PAGEDLLM_CPU_ISA=avx2`, an AVX2 machine); the portable and AVX2 paths have their own.
use super::gemm16::{product_avx2, product_vnni, Panel};
use super::int16::{self, QuantizedRows};
use super::tests::{floats, int16_reference, int16_types, int16_x, random_rows, QUANTIZED_TYPES};
use super::vnni::{row_dots_vnni, Planes};
use super::{quant_linear_with, vnni4, Activations, QType, QuantMatrix, Segment};
use crate::cpu::linear::PANEL;

#[test]
fn planes_split_each_code_into_a_signed_high_and_an_unsigned_low_byte() {
    let k = 96;
    let x = int16_x(2, k);
    let xq = QuantizedRows::new(&x, k, false);
    let planes = Planes::new(&xq, 2, k, &[]);
    for i in 0..2 {
        let (q, p) = (xq.row(i).q, planes.row(i));
        for (e, code) in q.iter().enumerate() {
            // SAFETY: e < k: inside the row's planes
            let (hi, lo) = unsafe { (*p.hi.add(e), *p.lo.add(e)) };
            assert_eq!(
                256 * i32::from(hi) + i32::from(lo),
                i32::from(*code),
                "row {i} {e}"
            );
        }
        for (b, c) in q.chunks_exact(16).enumerate() {
            assert_eq!(p.sum16[b], c.iter().map(|v| i32::from(*v)).sum::<i32>());
        }
        for (b, c) in q.chunks_exact(32).enumerate() {
            assert_eq!(p.sum32[b], c.iter().map(|v| i32::from(*v)).sum::<i32>());
            let hi: i32 = c.iter().map(|v| i32::from(v >> 8)).sum();
            assert_eq!(p.hsum[b], 32768 * hi);
        }
    }
}

#[test]
fn vnni_row_dots_equal_the_portable_and_avx2_ones_bit_for_bit() {
    if !super::vnni() {
        return;
    }
    // 96, 224, 320: a last group of 3, 7 and 2 blocks (odd counts read x's padding)
    let cases = int16_types()
        .flat_map(|t| [96, 224, 256, 320, 768].map(|k| (t, k)))
        .filter(|(t, k)| k % t.block().0 == 0);
    for (t, k) in cases {
        let x = int16_x(4, k);
        let xq = QuantizedRows::new(&x, k, true);
        let planes = Planes::new(&xq, 4, k, &[]);
        let rows: [int16::Row<'_>; 4] = std::array::from_fn(|i| xq.row(i));
        let p: [_; 4] = std::array::from_fn(|i| planes.row(i));
        let data = random_rows(t, 4, k, t as u64 + 29);
        let bytes = t.row_bytes(k).unwrap();
        for row in data.chunks_exact(bytes) {
            let portable: Vec<u32> = rows
                .iter()
                .map(|x| int16::row_dot(t, row, *x).to_bits())
                .collect();
            // SAFETY: vnni() (AVX-512 with VNNI granted, AVX2 with it); rows of k elements
            let (one, three, four, avx2) = unsafe {
                (
                    row_dots_vnni::<1>(t, row, k, &[rows[2]], &[p[2]]),
                    row_dots_vnni::<3>(
                        t,
                        row,
                        k,
                        &[rows[1], rows[2], rows[3]],
                        &[p[1], p[2], p[3]],
                    ),
                    row_dots_vnni::<4>(t, row, k, &rows, &p),
                    int16::row_dots_avx2::<4>(t, row, k, &rows),
                )
            };
            let name = t.name();
            assert_eq!(one[0].to_bits(), portable[2], "{name} k {k}");
            assert_eq!(
                three.map(f32::to_bits).to_vec(),
                portable[1..],
                "{name} k {k}"
            );
            assert_eq!(four.map(f32::to_bits).to_vec(), portable, "{name} k {k}");
            assert_eq!(avx2.map(f32::to_bits).to_vec(), portable, "{name} k {k}");
        }
    }
}

#[test]
fn vnni_row_dots_are_exact_at_the_largest_codes() {
    if !super::vnni() {
        return;
    }
    // x's codes of ±32767 (high bytes -128 / 127) against weights of all-ones bytes, all-zero
    // bytes and random ones: the partial sums' bounds at their largest
    let k = 512;
    for t in int16_types() {
        for (s, x) in [(0, 1.0f32), (1, -1.0), (2, 1.0)] {
            let mut data = random_rows(t, 1, k, 7 + s);
            let size = t.block().1;
            let fill = [0xFFu8, 0x00, 0x80][s as usize];
            for b in data.chunks_exact_mut(size) {
                let keep: &[usize] = match t {
                    QType::Q6_K => &[208, 209],
                    QType::Q8_0 | QType::Q4_0 | QType::Q5_0 => &[0, 1],
                    _ => &[0, 1, 2, 3],
                };
                for (i, v) in b.iter_mut().enumerate() {
                    if !keep.contains(&i) {
                        *v = fill;
                    }
                }
            }
            let xs: Vec<f32> = (0..k).map(|i| if i % 3 == 0 { -x } else { x }).collect();
            let xq = QuantizedRows::new(&xs, k, true);
            let planes = Planes::new(&xq, 1, k, &[]);
            let want = int16::row_dot(t, &data, xq.row(0));
            // SAFETY: vnni(); a row of k elements
            let got = unsafe { row_dots_vnni::<1>(t, &data, k, &[xq.row(0)], &[planes.row(0)]) };
            assert_eq!(
                got[0].to_bits(),
                want.to_bits(),
                "{} fill {fill:#x}",
                t.name()
            );
        }
    }
}

#[test]
fn vnni_panel_products_equal_the_avx2_ones_bit_for_bit() {
    if !super::vnni() {
        return;
    }
    // 1-8 rows a tile and a partial last tile; full and partial panels
    let types = QUANTIZED_TYPES
        .into_iter()
        .filter(|t| super::gemm16::takes(*t));
    for t in types {
        for (m, count, k) in [(9, 16, 256), (13, 7, 512), (17, 16, 768), (40, 1, 256)] {
            let x: Vec<f32> = int16_x(m, k);
            let data = random_rows(t, count, k, m as u64);
            let rows: Vec<_> = data
                .chunks_exact(t.row_bytes(k).unwrap())
                .map(|r| (t, r))
                .collect();
            let xq = QuantizedRows::new(&x, k, true);
            let mut panel = Panel::default();
            panel.pack(&rows, k, true);
            let (mut avx2, mut vnni) = (vec![[f32::NAN; PANEL]; m], vec![[f32::NAN; PANEL]; m]);
            // SAFETY: vnni(): AVX-512 with VNNI granted, and AVX2 with it
            unsafe {
                product_avx2(&panel, &xq, &mut avx2);
                product_vnni(&panel, &xq, &mut vnni);
            }
            let bits = |s: &Vec<[f32; PANEL]>| -> Vec<u32> {
                s.iter().flatten().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&vnni), bits(&avx2), "{} {m}x{k}", t.name());
        }
    }
}

#[test]
fn four_row_vnni_dots_equal_the_one_row_ones_and_the_portable_ones_bit_for_bit() {
    if !super::vnni() {
        return;
    }
    // 96, 224, 320, 576: a last group of 3, 7, 2 and 2 blocks (odd counts read x's padding)
    let cases = int16_types()
        .filter(|t| vnni4::takes(*t))
        .flat_map(|t| [96, 224, 256, 320, 576, 768].map(|k| (t, k)))
        .filter(|(t, k)| k % t.block().0 == 0);
    for (t, k) in cases {
        let x = int16_x(1, k);
        let xq = QuantizedRows::new(&x, k, true);
        let planes = Planes::new(&xq, 1, k, &[]);
        let (xr, pr) = (xq.row(0), planes.row(0));
        let data = random_rows(t, 4, k, t as u64 + 41);
        let bytes = t.row_bytes(k).unwrap();
        let rows: [&[u8]; 4] = std::array::from_fn(|r| &data[r * bytes..(r + 1) * bytes]);
        // SAFETY: vnni() (AVX-512 with VNNI granted); rows of k elements
        let four = unsafe { vnni4::rows_dots_vnni(t, rows, k, &xr, &pr) };
        for (r, row) in rows.iter().enumerate() {
            // SAFETY: as above
            let one = unsafe { row_dots_vnni::<1>(t, row, k, &[xr], &[pr]) };
            let what = format!("{} k {k} row {r}", t.name());
            assert_eq!(four[r].to_bits(), one[0].to_bits(), "{what}");
            let portable = int16::row_dot(t, row, xr);
            assert_eq!(four[r].to_bits(), portable.to_bits(), "{what}");
            let (exact, size) = int16_reference(t, row, xr);
            let err = (f64::from(four[r]) - exact).abs();
            assert!(err <= size * 1e-6, "{what}: {} vs {exact}", four[r]);
        }
    }
}

#[test]
fn one_row_of_x_takes_weight_rows_four_a_pass_across_mixed_segments_and_run_splits() {
    // segments of 6 Q4_0, 3 Q5_K, 1 Q8_0 (AVX2 units), 5 Q6_K, 2 F32 and 7 Q4_1 rows: passes of
    // four, rows left over before a change of type, and runs cut by 1 or 2 threads
    let k = 768;
    let kinds = [
        (QType::Q4_0, 6),
        (QType::Q5_K, 3),
        (QType::Q8_0, 1),
        (QType::Q6_K, 5),
        (QType::F32, 2),
        (QType::Q4_1, 7),
    ];
    let data: Vec<Vec<u8>> = kinds
        .iter()
        .map(|(t, n)| random_rows(*t, *n, k, *n as u64 + 3))
        .collect();
    let segments = kinds
        .iter()
        .zip(&data)
        .map(|((t, n), d)| Segment {
            qtype: *t,
            data: d,
            rows: *n,
        })
        .collect();
    let w = QuantMatrix::new(segments, k).unwrap();
    let n = w.n();
    let x = floats(k, 0.75);
    let xq = QuantizedRows::new(&x, k, super::fast());
    let mut dense = ndarray::Array2::zeros((n, k));
    super::dequantize(&w, dense.view_mut()).unwrap();
    for threads in [1, 2] {
        let xa = ndarray::ArrayView2::from_shape((1, k), &x).unwrap();
        let mut out = ndarray::Array2::from_elem((1, n), f32::NAN);
        let int16 = Activations::Int16;
        quant_linear_with(xa, &w, None, out.view_mut(), threads, int16).unwrap();
        for c in 0..n {
            let (t, row) = w.row(c);
            let got = out[[0, c]];
            let what = format!("{} row {c} threads {threads}", t.name());
            if int16::takes(t) {
                let want = int16::row_dot(t, row, xq.row(0));
                assert_eq!(got.to_bits(), want.to_bits(), "{what}");
            }
            // every row near the float product of its dequantized weights
            let exact: f64 = (0..k)
                .map(|e| f64::from(dense[[c, e]]) * f64::from(x[e]))
                .sum();
            let size: f64 = (0..k)
                .map(|e| (f64::from(dense[[c, e]]) * f64::from(x[e])).abs())
                .sum();
            assert!(
                (f64::from(got) - exact).abs() <= size * 1e-4,
                "{what}: {got} vs {exact}"
            );
        }
    }
}

#[test]
fn repacked_q8_0_rows_on_vnni_equal_the_plain_rows_portable_products_bit_for_bit() {
    if !super::vnni() {
        return;
    }
    // `q8_0r::rows`: four weight rows a pass (one row of x) and one a pass (1-4 rows of x); a
    // last group of 3, 7, 2, 8 and 1 blocks (one block alone: the second half's lanes 0), and
    // rows of the largest codes (0x7F, 0x80: -128, 0xFF: -1) against x's codes of ±32767
    for k in [96, 224, 256, 576, 32] {
        for fill in [None, Some(0x7Fu8), Some(0x80), Some(0xFF)] {
            let x = match fill {
                None => int16_x(4, k),
                Some(_) => (0..4 * k)
                    .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
                    .collect(),
            };
            let xq = QuantizedRows::new(&x, k, true);
            let planes = Planes::new(&xq, 4, k, &[QType::Q8_0R]);
            let xs: [int16::Row<'_>; 4] = std::array::from_fn(|i| xq.row(i));
            let ps: [_; 4] = std::array::from_fn(|i| planes.row(i));
            let mut plain = random_rows(QType::Q8_0, 4, k, k as u64 + 5);
            if let Some(v) = fill {
                for b in plain.chunks_exact_mut(34) {
                    b[2..].fill(v);
                }
            }
            let mut repacked = vec![0u8; plain.len()];
            super::repack::repack(QType::Q8_0, &plain, &mut repacked, k).unwrap();
            let bytes = 34 * k / 32;
            let row = |d: &[u8], r: usize| -> Vec<u8> { d[r * bytes..(r + 1) * bytes].to_vec() };
            let rows: [Vec<u8>; 4] = std::array::from_fn(|r| row(&repacked, r));
            let want: Vec<Vec<u32>> = (0..4)
                .map(|r| {
                    let w = row(&plain, r);
                    xs.iter()
                        .map(|x| int16::row_dot(QType::Q8_0, &w, *x).to_bits())
                        .collect()
                })
                .collect();
            let what = format!("k {k} fill {fill:?}");
            let t = QType::Q8_0R;
            // SAFETY: vnni() (AVX-512 with VNNI granted); rows of k elements, x's planes in Q8_0R's
            // order
            let four = unsafe {
                vnni4::rows_dots_vnni(t, rows.each_ref().map(|r| &r[..]), k, &xs[1], &ps[1])
            };
            for r in 0..4 {
                assert_eq!(four[r].to_bits(), want[r][1], "{what} row {r}, four a pass");
                // SAFETY: as above
                let (one, all) = unsafe {
                    (
                        row_dots_vnni::<1>(t, &rows[r], k, &[xs[3]], &[ps[3]]),
                        row_dots_vnni::<4>(t, &rows[r], k, &xs, &ps),
                    )
                };
                assert_eq!(one[0].to_bits(), want[r][3], "{what} row {r}, one row of x");
                assert_eq!(
                    all.map(f32::to_bits).to_vec(),
                    want[r],
                    "{what} row {r}, four rows of x"
                );
            }
        }
    }
}

#[test]
fn k_quant_rows_four_a_pass_equal_the_portable_row_dots_for_1_to_8_rows_of_x() {
    // `kquant4`: 9 weight rows (two passes of four and one row alone, or runs cut by 2
    // threads), 1-8 rows of x (four weight rows by one or two rows of x a pass), k of 1, 2 and 6
    // super-blocks (1536: SmolLM2's ffn_down)
    for t in [QType::Q4_K, QType::Q6_K] {
        for k in [256usize, 512, 1536] {
            let n = 9;
            let data = random_rows(t, n, k, k as u64 + t as u64 + 7);
            let segments = vec![Segment {
                qtype: t,
                data: &data,
                rows: n,
            }];
            let w = QuantMatrix::new(segments, k).unwrap();
            for m in 1..=super::DECODE_MAX_ROWS {
                let mut x = int16_x(m, k);
                x[k - 1] = -3.0e4;
                let xq = QuantizedRows::new(&x, k, false);
                let xa = ndarray::Array2::from_shape_vec((m, k), x).unwrap();
                for threads in [1, 2] {
                    let mut out = ndarray::Array2::from_elem((m, n), f32::NAN);
                    let int16 = Activations::Int16;
                    quant_linear_with(xa.view(), &w, None, out.view_mut(), threads, int16).unwrap();
                    for c in 0..n {
                        let (_, row) = w.row(c);
                        for i in 0..m {
                            let want = int16::row_dot(t, row, xq.row(i));
                            let what =
                                format!("{} k {k} m {m} row {c} x {i} threads {threads}", t.name());
                            assert_eq!(out[[i, c]].to_bits(), want.to_bits(), "{what}");
                        }
                    }
                }
            }
        }
    }
}
