//! Greedy sampling's argmax over f32 logits `[K, V]`: each row's index of its largest value, the
//! first one on ties, the first NaN if the row holds one (torch's `argmax` rules).
//!
//! torch's CPU `argmax` reduces with index bookkeeping that does not vectorize (~2 ns an element
//! here, ~0.5 ms for eight rows of a 32k vocabulary); this scans eight lanes at a time.
use std::sync::Mutex;

use ndarray::ArrayView2;

use super::invalid;
use super::pool;
use crate::error::Result;

/// Logits below which a call runs on the calling thread alone.
const MIN_PER_THREAD: usize = 1 << 19;

/// `out[r]` = the argmax of row `r` of `logits` (contiguous); `num_threads` threads at most.
pub fn argmax_rows(logits: ArrayView2<f32>, out: &mut [i64], num_threads: usize) -> Result<()> {
    let (rows, vocab) = logits.dim();
    if out.len() != rows {
        return Err(invalid(format!(
            "argmax: logits have {rows} rows, out {} elements",
            out.len()
        )));
    }
    if vocab == 0 && rows > 0 {
        return Err(invalid("argmax: the logits have no columns"));
    }
    let logits = logits
        .to_slice()
        .ok_or_else(|| invalid("logits must be contiguous"))?;
    let threads = num_threads.clamp(1, (rows * vocab / MIN_PER_THREAD).max(1));
    if threads == 1 {
        for (row, o) in logits.chunks_exact(vocab).zip(out.iter_mut()) {
            *o = argmax(row) as i64;
        }
        return Ok(());
    }
    let chunks: Vec<Mutex<&mut [i64]>> = out.chunks_mut(1).map(Mutex::new).collect();
    pool::WORKERS.run_claimed(threads, rows, |r| {
        let mut o = chunks[r].lock().unwrap_or_else(|e| e.into_inner());
        o[0] = argmax(&logits[r * vocab..(r + 1) * vocab]) as i64;
    });
    Ok(())
}

/// The index of the first largest value of a non-empty row (of the first NaN, if any).
fn argmax(row: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 (checked above: the ISA level is AVX2 or above).
        if let Some(i) = unsafe { argmax_avx2(row) } {
            return i;
        }
    }
    argmax_scalar(row)
}

fn argmax_scalar(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            return i;
        }
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// None when the row holds a NaN (the scalar scan then finds the first).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn argmax_avx2(row: &[f32]) -> Option<usize> {
    use std::arch::x86_64::*;
    let whole = row.len() - row.len() % 8;
    if whole == 0 || row.len() > i32::MAX as usize {
        return Some(argmax_scalar(row));
    }
    let p = row.as_ptr();
    // per lane: its largest value so far and where it first appeared
    let mut best = _mm256_loadu_ps(p);
    let mut best_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut at = best_at;
    let eight = _mm256_set1_epi32(8);
    let mut nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(best, best);
    let mut i = 8;
    while i < whole {
        at = _mm256_add_epi32(at, eight);
        let v = _mm256_loadu_ps(p.add(i));
        let greater = _mm256_cmp_ps::<_CMP_GT_OQ>(v, best);
        best = _mm256_blendv_ps(best, v, greater);
        best_at = _mm256_blendv_epi8(best_at, at, _mm256_castps_si256(greater));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        i += 8;
    }
    if _mm256_movemask_ps(nan) != 0 {
        return None;
    }
    let mut values = [0.0f32; 8];
    let mut indices = [0i32; 8];
    _mm256_storeu_ps(values.as_mut_ptr(), best);
    _mm256_storeu_si256(indices.as_mut_ptr().cast(), best_at);
    // the largest lane value; on equal values the earliest index
    let mut top = 0;
    for l in 1..8 {
        if values[l] > values[top] || (values[l] == values[top] && indices[l] < indices[top]) {
            top = l;
        }
    }
    let (mut value, mut index) = (values[top], indices[top] as usize);
    for (j, &v) in row[whole..].iter().enumerate() {
        if v.is_nan() {
            return None;
        }
        if v > value {
            (value, index) = (v, whole + j);
        }
    }
    Some(index)
}

#[cfg(test)]
mod tests {
    use ndarray::Array2;

    use super::*;

    fn check(logits: &Array2<f32>, threads: usize) {
        let mut out = vec![-1; logits.nrows()];
        argmax_rows(logits.view(), &mut out, threads).unwrap();
        for (r, row) in logits.rows().into_iter().enumerate() {
            let want = argmax_scalar(row.as_slice().unwrap());
            assert_eq!(out[r], want as i64, "row {r}");
        }
    }

    #[test]
    fn each_row_gets_its_largest_index() {
        let logits =
            Array2::from_shape_fn((9, 1003), |(r, c)| ((r * 1009 + c * 7919) % 997) as f32);
        check(&logits, 1);
    }

    #[test]
    fn ties_go_to_the_first_index_across_lanes_and_the_tail() {
        let mut logits = Array2::from_elem((3, 35), 0.0f32);
        logits[[0, 13]] = 5.0; // lane 5 of the second chunk...
        logits[[0, 10]] = 5.0; // ...and lane 2 of it: the earlier wins
        logits[[1, 33]] = 2.0; // in the tail only
        logits[[2, 7]] = 1.0;
        logits[[2, 34]] = 1.0; // equal in the tail: the vector part's earlier one wins
        let mut out = vec![0; 3];
        argmax_rows(logits.view(), &mut out, 1).unwrap();
        assert_eq!(out, vec![10, 33, 7]);
    }

    #[test]
    fn a_nan_is_taken_as_torch_takes_it() {
        let mut logits = Array2::from_elem((2, 40), 1.0f32);
        logits[[0, 20]] = f32::NAN;
        logits[[0, 30]] = f32::NAN;
        logits[[0, 3]] = 9.0;
        logits[[1, 38]] = f32::NAN; // in the tail
        let mut out = vec![0; 2];
        argmax_rows(logits.view(), &mut out, 1).unwrap();
        assert_eq!(out, vec![20, 38]);
    }

    #[test]
    fn all_minus_infinity_gives_the_first_index() {
        let logits = Array2::from_elem((1, 17), f32::NEG_INFINITY);
        let mut out = vec![5; 1];
        argmax_rows(logits.view(), &mut out, 1).unwrap();
        assert_eq!(out, vec![0]);
    }

    #[test]
    fn rows_on_threads_give_the_same_indices() {
        let logits = Array2::from_shape_fn((40, 32000), |(r, c)| ((r * 31 + c * 17) % 4099) as f32);
        check(&logits, 3);
    }

    #[test]
    fn an_out_of_the_wrong_length_is_rejected() {
        let logits = Array2::<f32>::zeros((2, 8));
        let err = argmax_rows(logits.view(), &mut [0; 3], 1).unwrap_err();
        assert!(format!("{err}").contains("out 3 elements"), "{err}");
    }
}
