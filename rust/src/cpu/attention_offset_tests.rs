//! A fixed key offset on the store (`store_kv_offset`): each key is stored less it, in the same
//! pass, and attention over the stored keys is the attention over the keys themselves (softmax
//! ignores `q . c` for a `c` every key shares), up to rounding.
use ndarray::{Array2, Array3, Array4};

use super::attention::{paged_attention, store_kv, store_kv_offset, PagedBatch};
use super::kv_quant::{Fp8E4M3, KvElem, I8};

const KVH: usize = 2;
const D: usize = 64;
const BS: usize = 16;

/// Deterministic values in [-amp, amp) plus `shift`.
fn values(n: usize, seed: u64, amp: f32, shift: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp + shift
        })
        .collect()
}

fn offset() -> Array2<f32> {
    Array2::from_shape_vec((KVH, D), values(KVH * D, 7, 3.0, 0.0)).unwrap()
}

/// `C`'s zero: the cache's fill before the store
trait Zero: KvElem {
    const ZERO: Self;
}
impl Zero for f32 {
    const ZERO: Self = 0.0;
}
impl Zero for I8 {
    const ZERO: Self = I8(0);
}
impl Zero for Fp8E4M3 {
    const ZERO: Self = Fp8E4M3(0);
}

fn stored<C: Zero>(k: &Array3<f32>, v: &Array3<f32>, c: Option<&Array2<f32>>) -> Array4<C> {
    let t = k.dim().0;
    let blocks = t.div_ceil(BS);
    let mut kc = Array4::<C>::from_elem((blocks, BS, KVH, D + C::EXTRA), C::ZERO);
    let mut vc = kc.clone();
    let slots: Vec<i64> = (0..t as i64).collect();
    store_kv_offset(
        k.view(),
        v.view(),
        c.map(|c| c.view()),
        &slots,
        kc.view_mut(),
        vc.view_mut(),
    )
    .unwrap();
    // keys and values in one array: [2 * blocks, ..]
    ndarray::concatenate(ndarray::Axis(0), &[kc.view(), vc.view()]).unwrap()
}

fn rows(t: usize, seed: u64) -> Array3<f32> {
    // keys with a large shared part, as RoPE'd keys have: what the offset takes away
    Array3::from_shape_vec((t, KVH, D), values(t * KVH * D, seed, 1.0, 4.0)).unwrap()
}

fn bits<C: KvElem>(a: &Array4<C>) -> Vec<u32> {
    a.iter().map(|x| x.raw().to_bits()).collect()
}

fn a_key_offset_codes_the_keys_less_it<C: Zero>() {
    let (k, v) = (rows(40, 1), rows(40, 2));
    let c = offset();
    let shifted = &k - &c.view().insert_axis(ndarray::Axis(0));
    // storing k with the offset is storing k - c without: the same codes and scales, keys and
    // values (the values are not offset)
    assert_eq!(
        bits(&stored::<C>(&k, &v, Some(&c))),
        bits(&stored::<C>(&shifted, &v, None))
    );
}

#[test]
fn an_int8_store_with_a_key_offset_codes_the_keys_less_it() {
    a_key_offset_codes_the_keys_less_it::<I8>();
}

#[test]
fn an_fp8_store_with_a_key_offset_codes_the_keys_less_it() {
    a_key_offset_codes_the_keys_less_it::<Fp8E4M3>();
}

#[test]
fn a_float_store_with_a_key_offset_holds_the_keys_less_it() {
    let (k, v) = (rows(20, 3), rows(20, 4));
    let c = offset();
    let cache = stored::<f32>(&k, &v, Some(&c));
    let blocks = cache.dim().0 / 2;
    for t in 0..20 {
        for h in 0..KVH {
            for x in 0..D {
                let got = cache[[t / BS, t % BS, h, x]];
                assert_eq!(got.to_bits(), (k[[t, h, x]] - c[[h, x]]).to_bits());
                assert_eq!(cache[[blocks + t / BS, t % BS, h, x]], v[[t, h, x]]);
            }
        }
    }
}

/// One decode row per sequence over `len` cached positions, attention with and without the
/// offset on a cache of `C`.
fn attention_with_and_without<C: Zero>(len: usize) -> (Array3<f32>, Array3<f32>) {
    let (k, v) = (rows(len, 5), rows(len, 6));
    let q = Array3::from_shape_vec((1, 2 * KVH, D), values(2 * KVH * D, 8, 1.0, 0.0)).unwrap();
    let c = offset();
    let attend = |c: Option<&Array2<f32>>| {
        let cache = stored::<C>(&k, &v, c);
        let blocks = cache.dim().0 / 2;
        let (kc, vc) = cache.view().split_at(ndarray::Axis(0), blocks);
        let tables = Array2::from_shape_vec((1, blocks), (0..blocks as i32).collect()).unwrap();
        let batch = PagedBatch {
            query_start_loc: &[0, 1],
            seq_lens: &[len as i32],
            block_tables: tables.view(),
        };
        let mut out = Array3::<f32>::zeros(q.dim());
        let scale = (D as f32).powf(-0.5);
        paged_attention(q.view(), kc, vc, batch, scale, out.view_mut(), 1).unwrap();
        out
    };
    (attend(Some(&c)), attend(None))
}

#[test]
fn attention_over_keys_stored_less_an_offset_is_unchanged_up_to_rounding() {
    let (with, without) = attention_with_and_without::<f32>(70);
    for (a, b) in with.iter().zip(without.iter()) {
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
}

#[test]
fn int8_attention_over_keys_less_an_offset_stays_within_the_codes_error() {
    // the shared part of the keys taken away, the codes resolve the rest finer: the output
    // moves by no more than int8's error
    let (with, without) = attention_with_and_without::<I8>(70);
    for (a, b) in with.iter().zip(without.iter()) {
        assert!((a - b).abs() <= 2e-2, "{a} vs {b}");
    }
}

#[test]
fn a_key_offset_of_another_shape_is_refused() {
    let k = rows(1, 9);
    let mut kc = Array4::<I8>::from_elem((1, BS, KVH, D + 1), I8(0));
    let mut vc = kc.clone();
    let c = Array2::<f32>::zeros((KVH, D - 1));
    let err = store_kv_offset(
        k.view(),
        k.view(),
        Some(c.view()),
        &[0],
        kc.view_mut(),
        vc.view_mut(),
    );
    assert!(err.unwrap_err().to_string().contains("key_offset"));
    // without one: stored
    store_kv(k.view(), k.view(), &[0], kc.view_mut(), vc.view_mut()).unwrap();
}
