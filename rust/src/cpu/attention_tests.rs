//! The paged kernel against a dense, obviously-correct attention over the same context, in f32
//! and in bf16 (inputs exact in bf16, so the dense reference sees the very values the kernel
//! reads; the output then differs from it by the one final rounding to bf16).
use ndarray::{Array2, Array3, Array4, Axis};

use super::attention::{paged_attention, paged_attention_at, store_kv, PagedBatch, Scores};
use super::elem::{Bf16, Elem};
use super::isa::{self, IsaLevel};
use super::kv_quant::{self, Fp8E4M3, Fp8E5M2, KvElem, I8};

/// Deterministic pseudo-random values in [-1, 1), exact in `T`.
fn noise<T: Elem>(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            T::round(((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    /// (query tokens, context length) per sequence
    seqs: Vec<(usize, usize)>,
}

/// Dense reference: context of sequence s at position p is `ctx[s][p]`.
fn dense(
    case: &Case,
    q: &Array3<f32>,
    ks: &[Array3<f32>],
    vs: &[Array3<f32>],
    rule: Scores,
) -> Array3<f32> {
    let Scores {
        scale,
        window,
        softcap,
    } = rule;
    let group = case.heads / case.kv_heads;
    let mut out = Array3::<f32>::zeros(q.dim());
    let mut row = 0;
    for (s, &(q_len, len)) in case.seqs.iter().enumerate() {
        for i in 0..q_len {
            let visible = len - q_len + i + 1;
            // a sliding window: only the last `window` positions
            let first = if window == 0 {
                0
            } else {
                visible.saturating_sub(window)
            };
            for h in 0..case.heads {
                let g = h / group;
                let scores: Vec<f64> = (0..visible)
                    .map(|p| {
                        let x = (0..case.head_dim)
                            .map(|x| (q[[row, h, x]] * ks[s][[p, g, x]]) as f64)
                            .sum::<f64>()
                            * scale as f64;
                        let x = if softcap > 0.0 {
                            softcap as f64 * (x / softcap as f64).tanh()
                        } else {
                            x
                        };
                        if p < first {
                            f64::NEG_INFINITY
                        } else {
                            x
                        }
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for x in 0..case.head_dim {
                    let v: f64 = (0..visible)
                        .map(|p| weights[p] * vs[s][[p, g, x]] as f64)
                        .sum();
                    out[[row, h, x]] = (v / total) as f32;
                }
            }
            row += 1;
        }
    }
    out
}

fn check<T: Elem + KvElem>(case: Case, threads: usize) {
    check_in::<T, T>(case, threads)
}

/// The kernel over a cache of `C` (the model's float type, or a quantized format) against the
/// dense reference over the values the cache holds (dequantized): equal up to summation order.
fn check_in<T: Elem, C: KvElem>(case: Case, threads: usize) {
    check_scored::<T, C>(case, threads, 0, 0.0)
}

/// `check_in` for a layer with a sliding window and/or soft-capping. The table entries of blocks
/// wholly before each sequence's first query's window are -1 when the kernel runs: reading one
/// would index far outside the cache.
fn check_scored<T: Elem, C: KvElem>(case: Case, threads: usize, window: usize, softcap: f32) {
    check_levels::<T, C>(case, threads, window, softcap, false)
}

/// `check_scored`; `same_bits`: also the kernels of the AVX2 level, below the process's (the
/// AVX-512 one's), must give the very bits the process's level gave.
fn check_levels<T: Elem, C: KvElem>(
    case: Case,
    threads: usize,
    window: usize,
    softcap: f32,
    same_bits: bool,
) {
    let (h, kvh, d, bs) = (case.heads, case.kv_heads, case.head_dim, case.block_size);
    let row = d + C::EXTRA;
    let widths: Vec<usize> = case.seqs.iter().map(|(_, l)| l.div_ceil(bs)).collect();
    let width = widths.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks: usize = widths.iter().sum::<usize>() + 3;
    // blocks handed out in a scrambled order so that tables are not contiguous
    let mut free: Vec<i32> = (0..num_blocks as i32).rev().collect();
    free.swap(0, num_blocks / 2);
    let mut tables = Array2::<i32>::from_elem((case.seqs.len(), width), -1);
    // zeroed bytes: a valid value of every cache element type
    let zero = unsafe { std::mem::zeroed::<C>() };
    let mut k_cache = Array4::<C>::from_elem((num_blocks, bs, kvh, row), zero);
    let mut v_cache = Array4::<C>::from_elem((num_blocks, bs, kvh, row), zero);
    let total_q: usize = case.seqs.iter().map(|(q, _)| q).sum();
    let q = Array3::from_shape_vec((total_q, h, d), noise::<T>(total_q * h * d, 1)).unwrap();
    let (mut ks, mut vs) = (vec![], vec![]);
    // [prefix, this step's]: (keys, values, slots), stored by two calls as two steps would
    let mut steps: [(Vec<T>, Vec<T>, Vec<i64>); 2] = Default::default();
    let mut qsl = vec![0i32];
    for (s, &(q_len, len)) in case.seqs.iter().enumerate() {
        for j in 0..widths[s] {
            tables[[s, j]] = free.pop().unwrap();
        }
        let k = Array3::from_shape_vec((len, kvh, d), noise::<T>(len * kvh * d, 10 + s as u64))
            .unwrap();
        let v = Array3::from_shape_vec((len, kvh, d), noise::<T>(len * kvh * d, 99 + s as u64))
            .unwrap();
        for p in 0..len {
            let slot = tables[[s, p / bs]] as usize * bs + p % bs;
            let step = &mut steps[usize::from(p >= len - q_len)];
            step.0
                .extend(k.index_axis(Axis(0), p).iter().map(|x| T::from_f32(*x)));
            step.1
                .extend(v.index_axis(Axis(0), p).iter().map(|x| T::from_f32(*x)));
            step.2.push(slot as i64);
        }
        qsl.push(qsl[s] + q_len as i32);
        ks.push(k);
        vs.push(v);
    }
    for (k, v, slots) in steps {
        let k = Array3::from_shape_vec((slots.len(), kvh, d), k).unwrap();
        let v = Array3::from_shape_vec((slots.len(), kvh, d), v).unwrap();
        store_kv(
            k.view(),
            v.view(),
            &slots,
            k_cache.view_mut(),
            v_cache.view_mut(),
        )
        .unwrap();
    }
    // what the cache holds: the reference's keys and values
    for (s, (k, v)) in ks.iter_mut().zip(vs.iter_mut()).enumerate() {
        for p in 0..k.dim().0 {
            let slot = tables[[s, p / bs]] as usize * bs + p % bs;
            for g in 0..kvh {
                for (cache, dense) in [(&k_cache, &mut *k), (&v_cache, &mut *v)] {
                    let cached = cache.slice(ndarray::s![slot / bs, slot % bs, g, ..]);
                    let cached = cached.as_slice().unwrap();
                    let factor = unsafe { C::scale(cached.as_ptr(), d) };
                    let mut row: Vec<f32> = cached[..d].iter().map(|x| x.raw() * factor).collect();
                    if C::ROTATED {
                        // the cache holds the rotated row: its values are the rotation undone
                        kv_quant::unrotate(&mut row);
                    }
                    for x in 0..d {
                        dense[[p, g, x]] = row[x];
                    }
                }
            }
        }
    }
    if window > 0 {
        for (s, &(q_len, len)) in case.seqs.iter().enumerate() {
            for j in 0..(len - q_len + 1).saturating_sub(window) / bs {
                tables[[s, j]] = -1;
            }
        }
    }
    let lens: Vec<i32> = case.seqs.iter().map(|(_, l)| *l as i32).collect();
    let batch = PagedBatch {
        query_start_loc: &qsl,
        seq_lens: &lens,
        block_tables: tables.view(),
    };
    let rule = Scores {
        scale: (d as f32).powf(-0.5),
        window,
        softcap,
    };
    let q_in = q.mapv(T::from_f32);
    let mut out = Array3::<T>::from_elem((total_q, h, d), T::from_f32(f32::NAN));
    paged_attention(
        q_in.view(),
        k_cache.view(),
        v_cache.view(),
        batch,
        rule,
        out.view_mut(),
        threads,
    )
    .unwrap();
    if same_bits && isa::level() > IsaLevel::Avx2 {
        let mut lower = Array3::<T>::from_elem((total_q, h, d), T::from_f32(f32::NAN));
        paged_attention_at(
            IsaLevel::Avx2,
            q_in.view(),
            k_cache.view(),
            v_cache.view(),
            batch,
            rule,
            lower.view_mut(),
            threads,
        )
        .unwrap();
        let bits = |a: &Array3<T>| a.iter().map(|x| x.to_f32().to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&out) == bits(&lower),
            "{:?} differs from avx2",
            isa::level()
        );
    }
    let want = dense(&case, &q, &ks, &vs, rule);
    for (got, want) in out.iter().zip(want.iter()) {
        let got = got.to_f32();
        // f32 sums, then (bf16 only) the output's rounding: half an ulp, 2^-9 relative
        let rounding = if T::IS_BF16 { want.abs() / 256.0 } else { 0.0 };
        assert!((got - want).abs() <= 2e-5 + rounding, "{got} vs {want}");
    }
}

#[test]
fn decode_rows_with_grouped_heads_match_dense_attention() {
    let seqs = vec![(1, 1), (1, 17), (1, 64), (1, 130)];
    check::<f32>(
        Case {
            heads: 8,
            kv_heads: 2,
            head_dim: 16,
            block_size: 16,
            seqs,
        },
        1,
    );
}

#[test]
fn prefill_chunks_over_a_cached_prefix_are_causal() {
    // chunked prefill (prefix cached) and a whole prompt, with an odd block size
    let seqs = vec![(5, 12), (40, 40), (3, 3), (1, 9)];
    check::<f32>(
        Case {
            heads: 4,
            kv_heads: 4,
            head_dim: 12,
            block_size: 5,
            seqs,
        },
        1,
    );
}

#[test]
fn threads_split_long_prompts_and_give_the_same_result() {
    let seqs = vec![(150, 200), (1, 300), (70, 70), (1, 5)];
    check::<f32>(
        Case {
            heads: 6,
            kv_heads: 2,
            head_dim: 32,
            block_size: 8,
            seqs,
        },
        3,
    );
}

#[test]
fn bf16_decode_rows_over_several_blocks_with_grouped_heads_match_dense_attention() {
    let seqs = vec![(1, 1), (1, 17), (1, 64), (1, 130)];
    check::<Bf16>(
        Case {
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            seqs,
        },
        1,
    );
}

#[test]
fn bf16_prefill_chunks_over_a_cached_prefix_are_causal() {
    // odd head size: the SIMD loads' scalar tails
    let seqs = vec![(5, 12), (40, 40), (3, 3), (1, 9)];
    check::<Bf16>(
        Case {
            heads: 4,
            kv_heads: 4,
            head_dim: 20,
            block_size: 5,
            seqs,
        },
        1,
    );
}

#[test]
fn bf16_threads_split_long_prompts_and_give_the_same_result() {
    let seqs = vec![(150, 200), (1, 300), (70, 70), (1, 5)];
    check::<Bf16>(
        Case {
            heads: 6,
            kv_heads: 2,
            head_dim: 32,
            block_size: 8,
            seqs,
        },
        3,
    );
}

#[test]
fn rows_outside_every_sequence_are_zero_and_bad_tables_are_refused() {
    let q = Array3::<f32>::ones((3, 2, 4));
    let kc = Array4::<f32>::ones((2, 4, 1, 4));
    let vc = Array4::<f32>::ones((2, 4, 1, 4));
    let tables = Array2::<i32>::from_elem((1, 1), 1);
    let mut out = Array3::<f32>::from_elem((3, 2, 4), f32::NAN);
    let batch = PagedBatch {
        query_start_loc: &[0, 2],
        seq_lens: &[3],
        block_tables: tables.view(),
    };
    paged_attention(
        q.view(),
        kc.view(),
        vc.view(),
        batch,
        0.5,
        out.view_mut(),
        1,
    )
    .unwrap();
    assert!(out.index_axis(Axis(0), 2).iter().all(|x| *x == 0.0));
    assert!(out
        .index_axis(Axis(0), 0)
        .iter()
        .all(|x| (*x - 1.0).abs() < 1e-6));
    let bad = Array2::<i32>::from_elem((1, 1), 7);
    let batch = PagedBatch {
        block_tables: bad.view(),
        ..batch
    };
    let err = paged_attention(
        q.view(),
        kc.view(),
        vc.view(),
        batch,
        0.5,
        out.view_mut(),
        1,
    );
    assert!(err
        .unwrap_err()
        .to_string()
        .contains("block_tables[0, 0] = 7"));
    let short = PagedBatch {
        seq_lens: &[1],
        ..batch
    };
    assert!(paged_attention(
        q.view(),
        kc.view(),
        vc.view(),
        short,
        0.5,
        out.view_mut(),
        1
    )
    .is_err());
}

// The AVX2 path (head sizes that are a multiple of 8; the tests above with 12 and 20 take the
// portable one): many rows per kv head put the rows in the vector lanes, fewer than 8 the keys.

fn case(heads: usize, kv_heads: usize, head_dim: usize, seqs: Vec<(usize, usize)>) -> Case {
    Case {
        heads,
        kv_heads,
        head_dim,
        block_size: 16,
        seqs,
    }
}

/// Query counts around the 16-query tile and key counts around the 64-key tile, chunks that
/// start mid-block over a cached prefix, a whole prompt, and a decode row beside them.
fn tile_edges() -> Vec<(usize, usize)> {
    vec![
        (15, 15),
        (16, 16),
        (17, 17),
        (33, 100),
        (7, 64),
        (20, 65),
        (1, 129),
        (3, 130),
    ]
}

#[test]
fn prefill_tiles_match_dense_attention_for_every_group_ratio() {
    for kv_heads in [8, 4, 2, 1] {
        check::<f32>(case(8, kv_heads, 64, tile_edges()), 1);
    }
}

#[test]
fn head_size_128_matches_dense_attention() {
    check::<f32>(case(4, 2, 128, tile_edges()), 1);
}

#[test]
fn bf16_prefill_tiles_with_grouped_heads_match_dense_attention() {
    check::<Bf16>(case(8, 4, 64, tile_edges()), 1);
    check::<Bf16>(case(4, 1, 128, tile_edges()), 1);
}

#[test]
fn decode_rows_at_key_tile_edges_match_dense_attention() {
    // contexts not a multiple of 8 (the last eight-key group is partly past the tile's end)
    let seqs = [1, 2, 7, 8, 9, 63, 64, 65, 100, 128, 129, 511]
        .map(|len| (1, len))
        .to_vec();
    for kv_heads in [8, 4, 2] {
        check::<f32>(case(8, kv_heads, 64, seqs.clone()), 1);
    }
    check::<Bf16>(case(8, 4, 64, seqs), 1);
}

#[test]
fn a_few_queries_per_sequence_are_causal_with_keys_in_lanes() {
    // 2-3 queries x a group of 2 heads: fewer than 8 rows per kv head, on the causal diagonal
    let seqs = vec![(2, 2), (3, 3), (3, 66), (2, 64), (3, 17)];
    check::<f32>(case(8, 4, 64, seqs.clone()), 1);
    check::<f32>(case(4, 4, 32, seqs), 1);
}

#[test]
fn diagonal_tiles_mask_the_keys_after_each_query() {
    // long chunks whose queries cross several key tiles, with and without a cached prefix
    let seqs = vec![(200, 200), (130, 190), (64, 64), (65, 129)];
    check::<f32>(case(4, 2, 64, seqs), 1);
}

#[test]
fn threads_give_the_same_result_on_the_avx2_path() {
    let seqs = vec![(150, 200), (1, 300), (70, 70), (1, 5), (3, 40)];
    check::<f32>(case(8, 2, 64, seqs.clone()), 3);
    check::<Bf16>(case(8, 2, 64, seqs), 2);
}

// Quantized caches (int8, fp8): the kernel reads the codes and their row scales where they lie
// and must equal the dense attention over the dequantized values, on every path (keys in lanes
// for decode, rows in lanes for prefill, the portable loop for a head size not a multiple of 8).

#[test]
fn int8_cache_decode_and_prefill_match_dense_attention_over_its_values() {
    check_in::<f32, I8>(case(8, 2, 64, tile_edges()), 1);
    check_in::<Bf16, I8>(case(8, 4, 64, tile_edges()), 1);
    check_in::<f32, I8>(case(4, 2, 128, vec![(1, 511), (1, 7), (40, 90)]), 2);
}

#[test]
fn fp8_caches_decode_and_prefill_match_dense_attention_over_their_values() {
    check_in::<f32, Fp8E4M3>(case(8, 2, 64, tile_edges()), 1);
    check_in::<Bf16, Fp8E4M3>(case(8, 4, 64, tile_edges()), 1);
    check_in::<f32, Fp8E5M2>(case(8, 2, 64, tile_edges()), 1);
}

#[test]
fn quantized_caches_with_a_head_size_not_a_multiple_of_8_take_the_portable_loop() {
    check_in::<f32, I8>(case(4, 2, 20, vec![(1, 70), (17, 40)]), 1);
    check_in::<Bf16, Fp8E4M3>(case(4, 2, 20, vec![(1, 70), (17, 40)]), 1);
}

#[test]
fn a_quantized_cache_without_room_for_the_scale_is_refused() {
    let k = Array3::<f32>::zeros((1, 1, 8));
    let mut cache = Array4::<I8>::from_elem((1, 4, 1, 8), I8(0));
    let mut other = cache.clone();
    let err = store_kv(k.view(), k.view(), &[0], cache.view_mut(), other.view_mut());
    assert!(err.unwrap_err().to_string().contains("scale"));
}

// Sliding-window layers (Mistral, Gemma, Qwen2 `use_sliding_window`) and Gemma 2's soft-capping:
// every path (keys in lanes, rows in lanes, the portable loop), windows smaller and larger than
// a query tile, a key tile and a block; blocks before the window are -1 in the table.

#[test]
fn a_sliding_window_hides_old_keys_and_skips_their_blocks_on_the_avx2_path() {
    for window in [1, 5, 16, 20, 64, 100] {
        check_scored::<f32, f32>(case(8, 2, 64, tile_edges()), 1, window, 0.0);
    }
    let long = vec![(200, 200), (130, 190), (1, 511), (3, 300)];
    check_scored::<f32, f32>(case(4, 2, 64, long.clone()), 1, 32, 0.0);
    check_scored::<Bf16, Bf16>(case(8, 4, 64, long), 2, 48, 0.0);
}

#[test]
fn a_sliding_window_hides_old_keys_on_the_portable_path_and_quantized_caches() {
    let seqs = vec![(1, 70), (17, 40), (40, 90), (5, 12)];
    for window in [1, 7, 16, 33] {
        check_scored::<f32, f32>(case(4, 2, 20, seqs.clone()), 1, window, 0.0);
    }
    check_scored::<f32, I8>(case(8, 2, 64, tile_edges()), 1, 24, 0.0);
}

#[test]
fn a_window_as_long_as_the_context_is_full_attention() {
    check_scored::<f32, f32>(case(8, 2, 64, tile_edges()), 1, 4096, 0.0);
}

#[test]
fn soft_capped_scores_match_dense_attention_on_every_path() {
    // a cap near the scores' size so that tanh bends them
    check_scored::<f32, f32>(case(8, 2, 64, tile_edges()), 1, 0, 0.5);
    check_scored::<f32, f32>(case(4, 2, 20, vec![(1, 70), (17, 40)]), 1, 0, 0.5);
    check_scored::<f32, f32>(case(8, 2, 64, tile_edges()), 1, 16, 0.5);
}

// The AVX-512 level (where the machine has it) against the AVX2 level, bit for bit: its loops keep
// the AVX2 path's sums in the same order (`attention_avx512`). On a machine without AVX-512 these
// check the process's level against the dense reference only.

fn same_bits<T: Elem, C: KvElem>(case: Case, threads: usize, window: usize, softcap: f32) {
    check_levels::<T, C>(case, threads, window, softcap, true)
}

#[test]
fn avx512_decode_and_prefill_give_the_avx2_bits_for_float_caches() {
    for kv_heads in [8, 4, 2, 1] {
        same_bits::<f32, f32>(case(8, kv_heads, 64, tile_edges()), 1, 0, 0.0);
    }
    same_bits::<Bf16, Bf16>(case(8, 4, 64, tile_edges()), 1, 0, 0.0);
    same_bits::<Bf16, Bf16>(case(4, 1, 128, tile_edges()), 2, 0, 0.0);
}

#[test]
fn avx512_decode_scoring_three_rows_per_pass_gives_the_avx2_bits() {
    // groups of 3 (every row in one pass) and 5 (a pair, then three), float keys
    for d in [64, 40] {
        same_bits::<f32, f32>(case(9, 3, d, tile_edges()), 1, 0, 0.0);
        same_bits::<f32, f32>(case(10, 2, d, tile_edges()), 1, 0, 0.0);
    }
    same_bits::<Bf16, Bf16>(case(9, 3, 64, tile_edges()), 1, 0, 0.0);
    same_bits::<f32, f32>(case(9, 3, 64, tile_edges()), 2, 32, 0.5);
}

#[test]
fn avx512_decode_and_prefill_give_the_avx2_bits_for_quantized_caches() {
    same_bits::<f32, I8>(case(8, 2, 64, tile_edges()), 1, 0, 0.0);
    same_bits::<Bf16, I8>(case(12, 4, 64, tile_edges()), 1, 0, 0.0);
    same_bits::<f32, Fp8E4M3>(case(8, 2, 64, tile_edges()), 1, 0, 0.0);
    same_bits::<Bf16, Fp8E4M3>(case(8, 4, 128, tile_edges()), 1, 0, 0.0);
    same_bits::<f32, Fp8E5M2>(case(8, 8, 64, tile_edges()), 1, 0, 0.0);
}

#[test]
fn avx512_gives_the_avx2_bits_for_head_sizes_not_a_multiple_of_16() {
    // the 8-column tails of the 16-lane loops (40, 24, 8) and the portable loop (20)
    let seqs = vec![(1, 70), (17, 40), (1, 129), (40, 90)];
    for d in [40, 24, 8, 20] {
        same_bits::<f32, f32>(case(8, 2, d, seqs.clone()), 1, 0, 0.0);
        same_bits::<Bf16, I8>(case(8, 4, d, seqs.clone()), 1, 0, 0.0);
        same_bits::<f32, Fp8E4M3>(case(4, 4, d, seqs.clone()), 1, 0, 0.0);
    }
}

#[test]
fn avx512_gives_the_avx2_bits_with_windows_soft_caps_and_threads() {
    let long = vec![(200, 200), (130, 190), (1, 511), (3, 300), (1, 5)];
    same_bits::<f32, f32>(case(4, 2, 64, long.clone()), 3, 32, 0.0);
    same_bits::<Bf16, Bf16>(case(8, 4, 64, long.clone()), 2, 48, 0.5);
    same_bits::<f32, I8>(case(8, 2, 64, long), 2, 0, 0.5);
}
