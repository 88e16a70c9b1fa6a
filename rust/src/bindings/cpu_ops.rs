//! The CPU kernels (`crate::cpu`) for the model runner: torch CPU tensors arrive as numpy views
//! of the same memory (`Tensor.numpy()`, no copy), the kernels run with the GIL released.
use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray3,
    PyReadwriteArray4,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpu::{self, PagedBatch};

fn contiguous<'a, T: numpy::Element>(name: &str, a: &'a PyReadonlyArray1<T>) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{name} must be a contiguous 1-D array")))
}

/// Writes k/v `[T, KVH, D]` (float32) into the caches `[blocks, block_size, KVH, D]` at
/// `slot_mapping` (int64 `[T]`, -1 = padding row, skipped).
#[pyfunction]
fn cpu_store_kvcache(
    py: Python<'_>,
    k: PyReadonlyArray3<'_, f32>,
    v: PyReadonlyArray3<'_, f32>,
    mut k_cache: PyReadwriteArray4<'_, f32>,
    mut v_cache: PyReadwriteArray4<'_, f32>,
    slot_mapping: PyReadonlyArray1<'_, i64>,
) -> PyResult<()> {
    let slots = contiguous("slot_mapping", &slot_mapping)?;
    let (k, v) = (k.as_array(), v.as_array());
    let (kc, vc) = (k_cache.as_array_mut(), v_cache.as_array_mut());
    py.detach(|| cpu::store_kv(k, v, slots, kc, vc))?;
    Ok(())
}

/// Paged attention of q `[T, H, D]` over the caches into `out` `[T, H, D]` (float32, contiguous),
/// causal within each sequence's query rows; `num_threads` workers at most.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cpu_paged_attention(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, f32>,
    k_cache: PyReadonlyArray4<'_, f32>,
    v_cache: PyReadonlyArray4<'_, f32>,
    query_start_loc: PyReadonlyArray1<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    scale: f32,
    mut out: PyReadwriteArray3<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let batch = PagedBatch {
        query_start_loc: contiguous("query_start_loc", &query_start_loc)?,
        seq_lens: contiguous("seq_lens", &seq_lens)?,
        block_tables: block_tables.as_array(),
    };
    let (q, kc, vc) = (q.as_array(), k_cache.as_array(), v_cache.as_array());
    let out = out.as_array_mut();
    py.detach(|| cpu::paged_attention(q, kc, vc, batch, scale, out, num_threads))?;
    Ok(())
}

/// Rotates the heads of x `[T, heads, D]` (float32, each head contiguous; e.g. the q/k columns of
/// the fused projection) in place by cos/sin `[T, D / 2]`: halves (a, b) -> (a·cos − b·sin,
/// b·cos + a·sin).
#[pyfunction]
fn cpu_rotary_in_place(
    py: Python<'_>,
    mut x: PyReadwriteArray3<'_, f32>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
) -> PyResult<()> {
    let x = x.as_array_mut();
    let (cos, sin) = (cos.as_array(), sin.as_array());
    py.detach(|| cpu::rotary_in_place(x, cos, sin))?;
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_store_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_rotary_in_place, m)?)?;
    Ok(())
}
