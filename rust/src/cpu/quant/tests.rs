//! Hand-built blocks of every type against the values their layout defines, the AVX2 rows
//! against the portable ones, and `quant_linear` against an f64 product of the dequantized
//! weight (the Python tests check the formats against the `gguf` package).
use ndarray::Array2;

use super::formats::{dequantize_blocks, f16_to_f32, f32_to_f16, QType};
use super::*;

const ONE: u16 = 0x3C00; // f16 1.0
const HALF: u16 = 0x3800; // f16 0.5
const TWO: u16 = 0x4000; // f16 2.0
const MINUS_ONE: u16 = 0xBC00; // f16 -1.0

fn dequantized(t: QType, block: &[u8]) -> Vec<f32> {
    let mut y = vec![f32::NAN; t.block().0 * block.len() / t.block().1];
    dequantize_blocks(t, block, &mut y);
    y
}

/// The quant tests' pseudo-random source (xorshift), the same stream for the same seed.
pub(super) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// A pseudo-random byte stream, the same for the same seed.
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut next = xorshift(seed);
    (0..len).map(|_| (next() >> 24) as u8).collect()
}

/// `rows` random rows of type `t` with small, finite f16 scales (random bytes elsewhere).
pub(super) fn random_rows(t: QType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    if repack::repacked(t) {
        let plain = random_rows(repack::read_as(t), rows, k, seed);
        let mut repacked = vec![0; plain.len()];
        repack::repack(repack::read_as(t), &plain, &mut repacked, k).unwrap();
        return repacked;
    }
    let (elems, size) = t.block();
    let mut data = bytes(rows * k / elems * size, seed);
    let scale_at: &[usize] = match t {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => &[0],
        QType::Q4_0R | QType::Q5_0R | QType::Q8_0R | QType::Q4_1R => {
            unreachable!("repacked from plain rows above")
        }
        QType::Q4_1 | QType::Q5_1 | QType::Q4_K | QType::Q5_K => &[0, 2],
        QType::Q6_K => &[208],
        QType::F16 => &[0],
        QType::F32 | QType::BF16 => &[],
    };
    for (b, block) in data.chunks_exact_mut(size).enumerate() {
        match t {
            QType::F32 => block.copy_from_slice(&(((b % 97) as f32 - 48.0) / 32.0).to_le_bytes()),
            QType::BF16 => block[1] = 0x3C | (block[1] & 0x81), // |x| in [2^-7, 1)
            _ => {}
        }
        for at in scale_at {
            let v = (((block[*at] as f32) - 128.0) / 4096.0).max(-0.03);
            block[*at..*at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
        }
    }
    data
}

#[test]
fn f16_round_trips_and_rounds_to_nearest_even() {
    for h in (0..=u16::MAX).filter(|h| (h >> 10) & 0x1F != 31) {
        assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#06x}");
    }
    assert_eq!(f16_to_f32(ONE), 1.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    // halfway between 1.0 and the next half (1 + 2^-10): ties go to the even significand
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), ONE);
    assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), ONE + 2);
    assert_eq!(f32_to_f16(70000.0), 0x7C00);
    assert_eq!(f32_to_f16(2f32.powi(-26)), 0);
}

#[test]
fn q8_0_is_its_scale_times_each_signed_byte() {
    let mut b = HALF.to_le_bytes().to_vec();
    b.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let want: Vec<f32> = (0..32).map(|i| 0.5 * (i as f32 - 16.0)).collect();
    assert_eq!(dequantized(QType::Q8_0, &b), want);
}

#[test]
fn q4_0_holds_the_first_half_in_low_nibbles_and_the_second_in_high_ones() {
    let mut b = TWO.to_le_bytes().to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantized(QType::Q4_0, &b);
    for j in 0..16 {
        assert_eq!(y[j], 2.0 * (j as f32 - 8.0));
        assert_eq!(y[j + 16], 2.0 * (7.0 - j as f32));
    }
}

#[test]
fn q4_1_adds_its_min_to_the_scaled_nibbles() {
    let mut b = [HALF.to_le_bytes(), MINUS_ONE.to_le_bytes()].concat();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dequantized(QType::Q4_1, &b);
    for j in 0..16 {
        assert_eq!(y[j], 0.5 * j as f32 - 1.0);
        assert_eq!(y[j + 16], 0.5 * (15 - j) as f32 - 1.0);
    }
}

#[test]
fn q5_0_and_q5_1_take_bit_4_of_element_j_from_bit_j_of_qh() {
    let qh: u32 = 0xA5C3_0F81;
    let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
    let q = |j: usize| {
        let nibble = if j < 16 {
            j as u32
        } else {
            15 - (j as u32 - 16)
        };
        (nibble | (((qh >> j) & 1) << 4)) as f32
    };
    let b0 = [&ONE.to_le_bytes()[..], &qh.to_le_bytes(), &qs].concat();
    let y0 = dequantized(QType::Q5_0, &b0);
    let b1 = [
        &HALF.to_le_bytes()[..],
        &TWO.to_le_bytes(),
        &qh.to_le_bytes(),
        &qs,
    ]
    .concat();
    let y1 = dequantized(QType::Q5_1, &b1);
    for j in 0..32 {
        assert_eq!(y0[j], q(j) - 16.0, "Q5_0 element {j}");
        assert_eq!(y1[j], 0.5 * q(j) + 2.0, "Q5_1 element {j}");
    }
}

/// Packs 8 six-bit (scale, min) pairs the way Q4_K / Q5_K store them.
fn pack_k_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for i in 0..4 {
        s[i] = (sc[i] & 63) | ((sc[i + 4] >> 4) << 6);
        s[i + 4] = (m[i] & 63) | ((m[i + 4] >> 4) << 6);
        s[i + 8] = (sc[i + 4] & 0xF) | ((m[i + 4] & 0xF) << 4);
    }
    s
}

#[test]
fn q4_k_and_q5_k_scale_each_sub_block_by_its_six_bit_scale_and_min() {
    let sc = [1, 2, 3, 63, 17, 40, 5, 33];
    let m = [0, 9, 63, 4, 50, 7, 21, 16];
    let scales = pack_k_scales(sc, m);
    let qs = bytes(128, 1);
    let qh = bytes(32, 2);
    let head = [&ONE.to_le_bytes()[..], &HALF.to_le_bytes(), &scales].concat();
    let y4 = dequantized(QType::Q4_K, &[&head[..], &qs].concat());
    let y5 = dequantized(QType::Q5_K, &[&head[..], &qh, &qs].concat());
    for e in 0..256 {
        let (i, l) = (e / 32, e % 32);
        let nibble = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 0xF;
        let high = (qh[l] >> i) & 1;
        let (dl, ml) = (sc[i] as f32, 0.5 * m[i] as f32);
        assert_eq!(y4[e], dl * nibble as f32 - ml, "Q4_K element {e}");
        assert_eq!(
            y5[e],
            dl * (nibble | high << 4) as f32 - ml,
            "Q5_K element {e}"
        );
    }
}

#[test]
fn q6_k_rebuilds_the_six_bit_values_its_quantizer_packs() {
    // the packing of ggml's Q6_K quantizer: per half, l in 0..32, the values at l, l + 32,
    // l + 64, l + 96 share ql[l], ql[l + 32] (low nibbles) and qh[l] (2 bits each)
    let q: Vec<u8> = bytes(256, 3).iter().map(|v| v & 63).collect();
    let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
    for h in 0..2 {
        for l in 0..32 {
            let v = |j: usize| q[128 * h + l + 32 * j];
            ql[64 * h + l] = (v(0) & 0xF) | ((v(2) & 0xF) << 4);
            ql[64 * h + l + 32] = (v(1) & 0xF) | ((v(3) & 0xF) << 4);
            qh[32 * h + l] =
                (v(0) >> 4) | ((v(1) >> 4) << 2) | ((v(2) >> 4) << 4) | ((v(3) >> 4) << 6);
        }
    }
    let scales: Vec<u8> = (0..16).map(|i| (i * 9 - 70) as i8 as u8).collect();
    let b = [&ql[..], &qh, &scales, &TWO.to_le_bytes()].concat();
    let y = dequantized(QType::Q6_K, &b);
    for e in 0..256 {
        let want = (2.0 * scales[e / 16] as i8 as f32) * (q[e] as f32 - 32.0);
        assert_eq!(y[e], want, "element {e}");
    }
}

#[test]
fn float_rows_widen_exactly() {
    let f: Vec<f32> = vec![1.5, -2.25, 0.0, 3e-5];
    let b: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(dequantized(QType::F32, &b), f);
    let h: Vec<u8> = [ONE, MINUS_ONE, 0x0001]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(dequantized(QType::F16, &h), [1.0, -1.0, 2f32.powi(-24)]);
    let bf: Vec<u8> = [0x3F80u16, 0xC040]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(dequantized(QType::BF16, &bf), [1.0, -3.0]);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_rows_equal_the_portable_rows_bit_for_bit() {
    if !formats_avx2::available() {
        return;
    }
    for t in QType::ALL {
        let k = 512 + if t.block().0 == 1 { 5 } else { 0 }; // ragged vector tails of float rows
        let data = random_rows(t, 3, k, t as u64 + 7);
        let mut portable = vec![0.0; 3 * k];
        let mut fast = vec![1.0; 3 * k];
        dequantize_blocks(t, &data, &mut portable);
        // SAFETY: the CPU has avx2, fma and f16c (checked above)
        unsafe { formats_avx2::dequantize_blocks(t, &data, &mut fast) };
        assert!(portable.iter().all(|v| v.is_finite()), "{}", t.name());
        assert_eq!(
            portable.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{}",
            t.name()
        );
    }
}

/// `x W^T + b` in f64 over the dequantized weight.
fn reference(x: &Array2<f32>, w: &Array2<f32>, b: &[f32]) -> Array2<f64> {
    let (m, k) = x.dim();
    Array2::from_shape_fn((m, w.dim().0), |(r, c)| {
        (0..k)
            .map(|i| x[[r, i]] as f64 * w[[c, i]] as f64)
            .sum::<f64>()
            + b[c] as f64
    })
}

pub(super) fn floats(len: usize, seed: f32) -> Vec<f32> {
    (0..len).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
}

#[test]
fn quant_linear_matches_the_dequantized_product_for_decode_and_prefill_rows_and_mixed_types() {
    let k = 512;
    let types = [
        QType::Q4_K,
        QType::Q8_0,
        QType::Q6_K,
        QType::F16,
        QType::Q5_1,
    ];
    let rows = [5, 17, 3, 20, 1]; // N = 46: ragged panels, segments across panels
    let data: Vec<Vec<u8>> = types
        .iter()
        .zip(rows)
        .map(|(t, r)| random_rows(*t, r, k, r as u64))
        .collect();
    let segments = types
        .iter()
        .zip(rows)
        .zip(&data)
        .map(|((t, r), d)| Segment {
            qtype: *t,
            data: d,
            rows: r,
        })
        .collect();
    let w = QuantMatrix::new(segments, k).unwrap();
    let n = w.n();
    let mut dense = Array2::zeros((n, k));
    dequantize(&w, dense.view_mut()).unwrap();
    let bias = floats(n, 3.0);
    for m in [1, 3, 8, 9, 40] {
        let x = Array2::from_shape_vec((m, k), floats(m * k, m as f32)).unwrap();
        let want = reference(&x, &dense, &bias);
        for threads in [1, 2] {
            let mut out = Array2::from_elem((m, n), f32::NAN);
            quant_linear(x.view(), &w, Some(&bias), out.view_mut(), threads).unwrap();
            for (g, e) in out.iter().zip(&want) {
                let tol = 1e-5 * (1.0 + e.abs()) * (k as f64).sqrt();
                assert!((*g as f64 - e).abs() < tol, "m {m}: {g} vs {e}");
            }
        }
    }
}

#[test]
fn embedding_rows_are_the_dequantized_rows_and_bad_ids_are_rejected() {
    let k = 64;
    let data = random_rows(QType::Q8_0, 6, k, 9);
    let w = QuantMatrix::new(
        vec![Segment {
            qtype: QType::Q8_0,
            data: &data,
            rows: 6,
        }],
        k,
    )
    .unwrap();
    let mut dense = Array2::zeros((6, k));
    dequantize(&w, dense.view_mut()).unwrap();
    let mut out = Array2::zeros((3, k));
    embedding(&w, &[5, 0, 5], out.view_mut()).unwrap();
    for (i, id) in [5, 0, 5].into_iter().enumerate() {
        assert_eq!(out.row(i), dense.row(id));
    }
    let err = embedding(&w, &[6], Array2::zeros((1, k)).view_mut()).unwrap_err();
    assert!(format!("{err}").contains("token id 6"), "{err}");
}

#[test]
fn quantized_q8_0_and_q4_0_rows_dequantize_close_to_the_floats() {
    let (n, k) = (4, 64);
    let w = Array2::from_shape_vec((n, k), floats(n * k, 1.0)).unwrap();
    // Q8_0 rounds to the nearest of 255 steps of max / 127; Q4_0's 16 steps of max / 8 reach
    // -8 steps on the extreme's side but only 7 on the other: up to a whole step off there
    for (t, error) in [(QType::Q8_0, 0.51 / 127.0), (QType::Q4_0, 1.0 / 8.0)] {
        let mut q = Array2::zeros((n, t.row_bytes(k).unwrap()));
        quantize(w.view(), t, q.view_mut()).unwrap();
        let data = q.as_slice().unwrap();
        let m = QuantMatrix::new(
            vec![Segment {
                qtype: t,
                data,
                rows: n,
            }],
            k,
        )
        .unwrap();
        let mut back = Array2::zeros((n, k));
        dequantize(&m, back.view_mut()).unwrap();
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= error + 1e-3, "{}: {a} vs {b}", t.name());
        }
    }
}

#[test]
fn bad_segments_and_shapes_are_rejected_naming_the_problem() {
    let err = QType::from_code(16).unwrap_err();
    assert!(
        format!("{err}").contains("unsupported ggml type 16"),
        "{err}"
    );
    let data = vec![0u8; 34 * 2 - 1];
    let err = QuantMatrix::new(
        vec![Segment {
            qtype: QType::Q8_0,
            data: &data,
            rows: 1,
        }],
        64,
    )
    .unwrap_err();
    assert!(
        format!("{err}").contains("segment 0 (Q8_0) has 67 bytes"),
        "{err}"
    );
    let err = QType::Q4_K.row_bytes(300).unwrap_err();
    assert!(format!("{err}").contains("blocks of 256"), "{err}");
    let data = vec![0u8; 34 * 2];
    let w = QuantMatrix::new(
        vec![Segment {
            qtype: QType::Q8_0,
            data: &data,
            rows: 1,
        }],
        64,
    )
    .unwrap();
    let x = Array2::<f32>::zeros((2, 32));
    let err = quant_linear(x.view(), &w, None, Array2::zeros((2, 1)).view_mut(), 1).unwrap_err();
    assert!(format!("{err}").contains("x has 32 columns"), "{err}");
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_row_dots_equal_the_dequantized_rows_dot_within_rounding() {
    if !formats_avx2::available() {
        return;
    }
    let k = 512;
    let x: Vec<f32> = floats(3 * k, 4.0);
    let xsum: Vec<f32> = x.chunks_exact(32).map(|c| c.iter().sum()).collect();
    let rows = [0, 1, 2].map(|r| x[r * k..].as_ptr());
    let sums = [0, 1, 2].map(|r| xsum[r * k / 32..].as_ptr());
    // repacked rows reach the fused rows as their plain type (`repack::standard_row`)
    let fused = |t: &QType| dot_avx2::fused(*t) && !repack::repacked(*t);
    for t in QType::ALL.into_iter().filter(fused) {
        let row = random_rows(t, 1, k, t as u64 + 40);
        let mut w = vec![0.0; k];
        dequantize_blocks(t, &row, &mut w);
        // SAFETY: the CPU has avx2, fma and f16c (checked above); the row holds k elements of
        // t, each x row k floats, each xsum row k / 32
        let got = unsafe { dot_avx2::row_dots::<3>(t, &row, k, &rows, &sums) };
        for (r, g) in got.iter().enumerate() {
            let terms = (0..k).map(|i| x[r * k + i] as f64 * w[i] as f64);
            let want: f64 = terms.clone().sum();
            let size: f64 = terms.map(f64::abs).sum();
            assert!(
                (*g as f64 - want).abs() <= 1e-6 * size,
                "{} row {r}: {g} vs {want}",
                t.name()
            );
        }
    }
}

#[test]
fn panels_are_the_rows_transposed_on_either_path() {
    let (k, stride) = (45, 61); // 5 whole 8-column blocks and a ragged 5
    let rows = floats(16 * stride, 2.0);
    for fast in [false, super::fast()] {
        let mut panel = vec![f32::NAN; k * 16];
        matmul::transpose_into_panel(&rows, stride, k, &mut panel, fast);
        for i in 0..k {
            for j in 0..16 {
                assert_eq!(
                    panel[i * 16 + j],
                    rows[j * stride + i],
                    "fast {fast}: {i}, {j}"
                );
            }
        }
    }
}

#[test]
fn int8_activations_are_codes_of_at_most_127_times_a_scale_per_32_elements() {
    let x: Vec<f32> = floats(64, 1.0).iter().map(|v| v * 3.0).collect();
    let q = int8::QuantizedRows::new(&x, 64, false);
    let row = q.row(0);
    for (b, c) in x.chunks_exact(32).enumerate() {
        let amax = c.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert_eq!(row.d[b], amax / 127.0);
        let codes = &row.q[32 * b..32 * b + 32];
        assert_eq!(codes.iter().map(|v| v.unsigned_abs()).max(), Some(127));
        for (v, code) in c.iter().zip(codes) {
            assert!((v - row.d[b] * f32::from(*code)).abs() <= row.d[b] / 2.0 * 1.0001);
        }
        let sum: i32 = codes.iter().map(|v| i32::from(*v)).sum();
        assert_eq!(row.s[b], row.d[b] * sum as f32);
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn int8_avx2_row_dots_equal_the_portable_ones_bit_for_bit() {
    if !formats_avx2::available() {
        return;
    }
    // an odd count of blocks: the last one has no odd partner
    for (k, t) in [96, 256]
        .into_iter()
        .flat_map(|k| int8_types().map(move |t| (k, t)))
    {
        let x: Vec<f32> = floats(4 * k, 0.5);
        let xq = int8::QuantizedRows::new(&x, k, false);
        let rows: [int8::Row<'_>; 4] = std::array::from_fn(|i| xq.row(i));
        // random bytes: Q8_0 codes of -128 included
        let data = random_rows(t, 4, k, t as u64 + 11);
        let bytes = t.row_bytes(k).unwrap();
        for row in data.chunks_exact(bytes) {
            let portable: Vec<u32> = rows
                .iter()
                .map(|x| int8::row_dot(t, row, *x).to_bits())
                .collect();
            // SAFETY: the CPU has avx2, fma and f16c (checked above); rows of k elements
            let (one, four) = unsafe {
                (
                    int8::row_dots_avx2::<1>(t, row, k, &[rows[2]]),
                    int8::row_dots_avx2::<4>(t, row, k, &rows),
                )
            };
            assert_eq!(one[0].to_bits(), portable[2], "{}", t.name());
            assert_eq!(four.map(f32::to_bits).to_vec(), portable, "{}", t.name());
        }
    }
}

#[test]
fn int8_row_dots_are_close_to_the_dequantized_rows_dot() {
    let k = 512;
    let x = floats(k, 2.0);
    let xq = int8::QuantizedRows::new(&x, k, false);
    for t in int8_types() {
        let data = random_rows(t, 1, k, t as u64 + 5);
        let mut w = vec![0.0; k];
        dequantize_blocks(t, &data, &mut w);
        let exact: f64 = x.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum();
        // each x within half a code of its block: d / 2 = (max |x| of the block) / 254
        let bound: f64 = (0..k)
            .map(|i| w[i].abs() as f64 * xq.row(0).d[i / 32] as f64 / 2.0)
            .sum();
        let got = int8::row_dot(t, &data, xq.row(0)) as f64;
        assert!(
            (got - exact).abs() <= bound * 1.001 + 1e-6,
            "{}: {got} vs {exact}",
            t.name()
        );
    }
}

#[test]
fn quant_linear_int8_takes_decode_rows_of_block_32_types_and_leaves_the_rest_exact() {
    let k = 256;
    let types = [
        QType::Q4_1,
        QType::Q6_K,
        QType::Q8_0,
        QType::F16,
        QType::Q5_0,
    ];
    let rows = [5, 3, 9, 2, 4];
    let data: Vec<Vec<u8>> = types
        .iter()
        .zip(rows)
        .map(|(t, r)| random_rows(*t, r, k, r as u64 + 40))
        .collect();
    let segments = types
        .iter()
        .zip(rows)
        .zip(&data)
        .map(|((t, r), d)| Segment {
            qtype: *t,
            data: d,
            rows: r,
        })
        .collect();
    let w = QuantMatrix::new(segments, k).unwrap();
    let n = w.n();
    let bias = floats(n, 7.0);
    for m in [1, 5, 8, 9] {
        let x = Array2::from_shape_vec((m, k), floats(m * k, m as f32)).unwrap();
        let mut exact = Array2::zeros((m, n));
        quant_linear(x.view(), &w, Some(&bias), exact.view_mut(), 1).unwrap();
        let xq = int8::QuantizedRows::new(x.as_slice().unwrap(), k, false);
        for threads in [1, 2] {
            let mut out = Array2::from_elem((m, n), f32::NAN);
            let int8 = Activations::Int8;
            quant_linear_with(x.view(), &w, Some(&bias), out.view_mut(), threads, int8).unwrap();
            for c in 0..n {
                let (t, row) = w.row(c);
                for i in 0..m {
                    let want = if m <= matmul::DECODE_MAX_ROWS && int8::takes(t) {
                        int8::row_dot(t, row, xq.row(i)) + bias[c]
                    } else {
                        exact[[i, c]]
                    };
                    assert_eq!(out[[i, c]].to_bits(), want.to_bits(), "m {m} row {c}");
                }
            }
        }
    }
}

#[test]
fn int8_activations_keep_a_nan_of_x_in_the_products() {
    let k = 64;
    let data = random_rows(QType::Q8_0, 1, k, 3);
    let mut x = floats(k, 1.0);
    x[40] = f32::NAN;
    let xq = int8::QuantizedRows::new(&x, k, false);
    assert!(int8::row_dot(QType::Q8_0, &data, xq.row(0)).is_nan());
}

/// The quantized ggml types (every type but the float rows), for each path's tests to filter
/// by what it takes (`int8::takes`, `int16::takes`, `gemm16::takes`).
pub(super) const QUANTIZED_TYPES: [QType; 8] = [
    QType::Q8_0,
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
];

/// The types the decode path's 8-bit products take.
fn int8_types() -> impl Iterator<Item = QType> {
    QUANTIZED_TYPES.into_iter().filter(|t| int8::takes(*t))
}

/// The types the decode path's 16-bit products take.
pub(super) fn int16_types() -> impl Iterator<Item = QType> {
    QUANTIZED_TYPES.into_iter().filter(|t| int16::takes(*t))
}

/// Rows of k elements of x: sines, and a block whose codes are ties (0.5, 1.5, ... at a scale
/// of 1) and a block of zeros.
pub(super) fn int16_x(rows: usize, k: usize) -> Vec<f32> {
    let mut x = floats(rows * k, 0.5);
    x[32..64].copy_from_slice(&std::array::from_fn::<f32, 32, _>(|i| i as f32 - 15.5));
    x[63] = 32767.0;
    x[64..96].fill(0.0);
    x
}

#[test]
fn int16_activations_are_codes_of_at_most_32767_times_a_scale_per_32_elements() {
    let k = 128;
    let x = int16_x(1, k);
    for fast in [false, super::fast()] {
        let q = int16::QuantizedRows::new(&x, k, fast);
        let row = q.row(0);
        for (b, c) in x.chunks_exact(32).enumerate() {
            let amax = c.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            assert_eq!(row.d[b], amax / 32767.0);
            let codes = &row.q[32 * b..32 * b + 32];
            let id = if row.d[b] != 0.0 { 1.0 / row.d[b] } else { 0.0 };
            for (v, code) in c.iter().zip(codes) {
                assert_eq!(*code, (v * id).round_ties_even() as i16);
            }
            let sum: i32 = codes.iter().map(|v| i32::from(*v)).sum();
            assert_eq!(row.s[b], row.d[b] * sum as f32);
        }
        // the ties block (scale 1): -15.5 -> -16, -14.5 -> -14, ..., 14.5 -> 14
        assert_eq!(&row.q[32..36], &[-16, -14, -14, -12]);
    }
}

#[test]
fn k_scales_unpacks_as_k_scale_min() {
    for seed in 0..64 {
        let s = bytes(12, seed);
        let (scales, mins) = int16::k_scales(&s);
        for i in 0..8 {
            assert_eq!((scales[i], mins[i]), formats::k_scale_min(&s, i));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn k_scale_floats_in_registers_are_k_scales() {
    use std::arch::x86_64::{__m256, _mm256_storeu_ps};
    if !(is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c"))
    {
        return;
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpacked(s: &[u8; 16]) -> ([f32; 8], [f32; 8]) {
        let lanes = |v: __m256| {
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), v);
            out
        };
        let (scales, mins) = int16::avx2::k_scale_floats(s.as_ptr());
        (lanes(scales), lanes(mins))
    }
    // random bytes and each byte's extremes (every 6-bit field 0 and 63 somewhere)
    let mut cases: Vec<[u8; 16]> = (0..256)
        .map(|seed| bytes(16, seed).try_into().unwrap())
        .collect();
    cases.extend([[0u8; 16], [0xFF; 16], [0xAA; 16], [0x55; 16]]);
    for s in cases {
        let (scales, mins) = int16::k_scales(&s[..12]);
        // SAFETY: AVX2, FMA and F16C checked above; 16 bytes at s
        let (fs, fm) = unsafe { unpacked(&s) };
        assert_eq!(fs, scales.map(f32::from), "{s:?}");
        assert_eq!(fm, mins.map(f32::from), "{s:?}");
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn int16_avx2_row_dots_equal_the_portable_ones_bit_for_bit() {
    if !formats_avx2::available() {
        return;
    }
    // 96: an odd count of blocks, the last one without an odd partner
    let cases = int16_types()
        .flat_map(|t| [96, 256, 768].map(|k| (t, k)))
        .filter(|(t, k)| k % t.block().0 == 0);
    for (t, k) in cases {
        let x = int16_x(4, k);
        let xq = int16::QuantizedRows::new(&x, k, true);
        let rows: [int16::Row<'_>; 4] = std::array::from_fn(|i| xq.row(i));
        let data = random_rows(t, 4, k, t as u64 + 17);
        let bytes = t.row_bytes(k).unwrap();
        for row in data.chunks_exact(bytes) {
            let portable: Vec<u32> = rows
                .iter()
                .map(|x| int16::row_dot(t, row, *x).to_bits())
                .collect();
            // SAFETY: the CPU has avx2, fma and f16c (checked above); rows of k elements
            let (one, four) = unsafe {
                (
                    int16::row_dots_avx2::<1>(t, row, k, &[rows[2]]),
                    int16::row_dots_avx2::<4>(t, row, k, &rows),
                )
            };
            assert_eq!(one[0].to_bits(), portable[2], "{} k {k}", t.name());
            assert_eq!(
                four.map(f32::to_bits).to_vec(),
                portable,
                "{} k {k}",
                t.name()
            );
        }
    }
}

/// The f64 dot of the dequantized row `data` (type `t`) and x as its 16-bit codes give it,
/// and the sum of |w · x| (the scale of f32 rounding).
pub(super) fn int16_reference(t: QType, data: &[u8], xq: int16::Row<'_>) -> (f64, f64) {
    let mut w = vec![0.0; xq.q.len()];
    dequantize_blocks(t, data, &mut w);
    let x = |i: usize| f64::from(xq.d[i / 32]) * f64::from(xq.q[i]);
    let exact = (0..w.len()).map(|i| f64::from(w[i]) * x(i)).sum();
    let size = (0..w.len()).map(|i| (f64::from(w[i]) * x(i)).abs()).sum();
    (exact, size)
}

#[test]
fn int16_row_dots_equal_the_dequantized_rows_dot_up_to_f32_rounding() {
    let k = 512;
    let x = floats(k, 2.0);
    for fast in [false, super::fast()] {
        let xq = int16::QuantizedRows::new(&x, k, fast);
        for t in int16_types() {
            let data = random_rows(t, 1, k, t as u64 + 5);
            let (exact, size) = int16_reference(t, &data, xq.row(0));
            let got = f64::from(int16::row_dot(t, &data, xq.row(0)));
            assert!(
                (got - exact).abs() <= size * 1e-6,
                "{}: {got} vs {exact}",
                t.name()
            );
            // and x's rounding to 16 bits is small: within half a code of each element
            let f32_dot: f64 = {
                let mut w = vec![0.0; k];
                dequantize_blocks(t, &data, &mut w);
                x.iter()
                    .zip(&w)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum()
            };
            assert!((got - f32_dot).abs() <= size * 1e-4, "{}", t.name());
        }
    }
}

#[test]
fn int16_products_do_not_overflow_at_the_largest_codes() {
    // every weight code at its extreme (Q8_0's -128, the 4/5-bit codes' 15 / 31 / -16, Q6_K's
    // -32 times a scale of -128) against x's codes of ±32767, signs matching the weights'
    let k = 256;
    for t in int16_types() {
        let (elems, size) = t.block();
        let mut data = vec![0u8; k / elems * size];
        for b in data.chunks_exact_mut(size) {
            match t {
                QType::Q8_0 => b[2..34].fill(0x80),
                QType::Q4_0 => b[2..18].fill(0x00),
                QType::Q4_1 => b[4..20].fill(0xFF),
                QType::Q5_0 => b[2..22].fill(0x00),
                QType::Q5_1 => b[4..24].fill(0xFF),
                QType::Q4_K => b[4..144].fill(0xFF),
                QType::Q5_K => b[4..176].fill(0xFF),
                QType::Q6_K => {
                    b[0..192].fill(0x00);
                    b[192..208].fill(0x80);
                }
                _ => unreachable!(),
            }
            let scale_at = if t == QType::Q6_K { 208 } else { 0 };
            b[scale_at..scale_at + 2].copy_from_slice(&ONE.to_le_bytes());
            if matches!(t, QType::Q4_1 | QType::Q5_1 | QType::Q4_K | QType::Q5_K) {
                b[2..4].copy_from_slice(&0u16.to_le_bytes());
            }
        }
        let mut w = vec![0.0; k];
        dequantize_blocks(t, &data, &mut w);
        let x: Vec<f32> = w
            .iter()
            .map(|v| if *v < 0.0 { -1.0 } else { 1.0 })
            .collect();
        for fast in [false, super::fast()] {
            let xq = int16::QuantizedRows::new(&x, k, fast);
            assert!(xq.row(0).q.iter().all(|q| q.abs() == 32767));
            let (exact, _) = int16_reference(t, &data, xq.row(0));
            let got = f64::from(int16::row_dot(t, &data, xq.row(0)));
            assert!(
                (got - exact).abs() <= exact.abs() * 1e-6,
                "{}: {got} vs {exact}",
                t.name()
            );
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: `fast`: the CPU has avx2, fma and f16c; rows of k elements
                let avx2 = unsafe { int16::row_dots_avx2::<1>(t, &data, k, &[xq.row(0)]) };
                assert_eq!(avx2[0].to_bits(), (got as f32).to_bits(), "{}", t.name());
            }
        }
    }
}

#[test]
fn quant_linear_int16_takes_decode_rows_of_quantized_types_and_leaves_the_rest_exact() {
    let k = 256;
    let types = [
        QType::Q4_K,
        QType::F16,
        QType::Q6_K,
        QType::Q8_0,
        QType::Q5_1,
    ];
    let rows = [5, 3, 9, 2, 4];
    let data: Vec<Vec<u8>> = types
        .iter()
        .zip(rows)
        .map(|(t, r)| random_rows(*t, r, k, r as u64 + 60))
        .collect();
    let segments = types
        .iter()
        .zip(rows)
        .zip(&data)
        .map(|((t, r), d)| Segment {
            qtype: *t,
            data: d,
            rows: r,
        })
        .collect();
    let w = QuantMatrix::new(segments, k).unwrap();
    let n = w.n();
    let bias = floats(n, 7.0);
    for m in [1, 5, 8, 9] {
        let x = Array2::from_shape_vec((m, k), floats(m * k, m as f32)).unwrap();
        let mut exact = Array2::zeros((m, n));
        quant_linear(x.view(), &w, Some(&bias), exact.view_mut(), 1).unwrap();
        let xq = int16::QuantizedRows::new(x.as_slice().unwrap(), k, false);
        for threads in [1, 2] {
            let mut out = Array2::from_elem((m, n), f32::NAN);
            let int16 = Activations::Int16;
            quant_linear_with(x.view(), &w, Some(&bias), out.view_mut(), threads, int16).unwrap();
            for c in 0..n {
                let (t, row) = w.row(c);
                for i in 0..m {
                    let want = if m <= matmul::DECODE_MAX_ROWS && int16::takes(t) {
                        int16::row_dot(t, row, xq.row(i)) + bias[c]
                    } else {
                        exact[[i, c]]
                    };
                    assert_eq!(out[[i, c]].to_bits(), want.to_bits(), "m {m} row {c}");
                }
            }
        }
    }
}

#[test]
fn int16_activations_keep_a_nan_of_x_in_the_products() {
    let k = 256;
    let mut x = floats(k, 1.0);
    x[40] = f32::NAN;
    for fast in [false, super::fast()] {
        let xq = int16::QuantizedRows::new(&x, k, fast);
        for t in int16_types() {
            let data = random_rows(t, 1, k, 3);
            assert!(int16::row_dot(t, &data, xq.row(0)).is_nan(), "{}", t.name());
        }
    }
}

#[test]
fn int16_activations_keep_a_nan_or_infinity_of_x_in_multi_row_products() {
    // the types without a min skip the mins on the AVX2 path from 2 rows of x: the NaN must
    // come through the block's scale alone
    let (m, k) = (4, 256);
    let mut x = floats(m * k, 1.0);
    x[k + 40] = f32::NAN;
    x[3 * k + 7] = f32::INFINITY;
    let x = Array2::from_shape_vec((m, k), x).unwrap();
    for t in int16_types() {
        let data = random_rows(t, 3, k, 5);
        let segments = vec![Segment {
            qtype: t,
            data: &data,
            rows: 3,
        }];
        let w = QuantMatrix::new(segments, k).unwrap();
        let mut out = Array2::from_elem((m, 3), 0.0f32);
        quant_linear_with(x.view(), &w, None, out.view_mut(), 1, Activations::Int16).unwrap();
        for c in 0..3 {
            assert!(
                out[[0, c]].is_finite() && out[[2, c]].is_finite(),
                "{}",
                t.name()
            );
            assert!(out[[1, c]].is_nan() && out[[3, c]].is_nan(), "{}", t.name());
        }
    }
}

#[test]
fn int16_decode_rows_equal_the_portable_row_dots_for_1_to_8_rows_and_partial_groups() {
    // the AVX2 products sum 8 units (blocks, Q6_K's halves) at a time: k of 1, 3, 7, 9 and 18
    // blocks leave a last group of 1-7, 256 and 768 whole super-blocks; 1-8 rows of x take
    // passes of 4, 3, 2 and 1 rows
    for t in int16_types() {
        for k in [32usize, 96, 224, 288, 576, 256, 768] {
            if !k.is_multiple_of(t.block().0) {
                continue;
            }
            let n = 3;
            let data = random_rows(t, n, k, k as u64 + t as u64);
            let segments = vec![Segment {
                qtype: t,
                data: &data,
                rows: n,
            }];
            let w = QuantMatrix::new(segments, k).unwrap();
            for m in 1..=matmul::DECODE_MAX_ROWS {
                let mut x = floats(m * k, m as f32 + 0.25);
                x[k - 1] = -3.0e4;
                let xq = int16::QuantizedRows::new(&x, k, false);
                let x = Array2::from_shape_vec((m, k), x).unwrap();
                let mut out = Array2::from_elem((m, n), f32::NAN);
                let int16 = Activations::Int16;
                quant_linear_with(x.view(), &w, None, out.view_mut(), 1, int16).unwrap();
                for c in 0..n {
                    let (_, row) = w.row(c);
                    for i in 0..m {
                        let want = int16::row_dot(t, row, xq.row(i));
                        let got = out[[i, c]];
                        let what = format!("{} k {k} m {m} row {c} x {i}", t.name());
                        assert_eq!(got.to_bits(), want.to_bits(), "{what}");
                        let (exact, size) = int16_reference(t, row, xq.row(i));
                        let err = (f64::from(got) - exact).abs();
                        assert!(err <= size * 1e-6, "{what}: {got} vs {exact}");
                    }
                }
            }
        }
    }
}
