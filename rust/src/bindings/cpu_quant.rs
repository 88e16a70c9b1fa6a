//! The quantized-weight CPU kernels (`crate::cpu::quant`): a weight crosses as a sequence of
//! `(ggml type code, uint8 array [rows, row_bytes])` segments viewed without a copy (numpy
//! views of the GGUF file's mmap'd tensors), activations and results as float32 arrays; the
//! kernels run with the GIL released.
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::cpu::quant::{self, Activations, QType, QuantMatrix, Segment};

/// A weight's segments as Python passes them: `(ggml type code, uint8 [rows, row_bytes])`.
pub(crate) type Segments<'py> = Vec<(u32, PyReadonlyArray2<'py, u8>)>;

/// The segments as the kernels' weight `[sum of rows, in_features]`; a ValueError naming the
/// segment that is not contiguous, of an unsupported type or of the wrong size.
pub(crate) fn matrix<'a>(
    segments: &'a Segments<'_>,
    in_features: usize,
) -> PyResult<QuantMatrix<'a>> {
    let parts = segments
        .iter()
        .enumerate()
        .map(|(i, (code, data))| {
            let qtype = QType::from_code(*code)?;
            let rows = data.shape()[0];
            let data = data.as_slice().map_err(|_| {
                PyValueError::new_err(format!("segment {i}'s bytes must be contiguous"))
            })?;
            Ok(Segment { qtype, data, rows })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(QuantMatrix::new(parts, in_features)?)
}

/// The quantized products' activations named "f32", "int8" or "int16"; a ValueError otherwise.
pub(crate) fn activations_named(name: &str) -> PyResult<Activations> {
    match name {
        "f32" => Ok(Activations::F32),
        "int8" => Ok(Activations::Int8),
        "int16" => Ok(Activations::Int16),
        _ => Err(PyValueError::new_err(format!(
            "activations {name:?}: expected 'f32', 'int8' or 'int16'"
        ))),
    }
}

/// A writeable float32 or uint8 `out` array.
fn writeable<'py, T: numpy::Element>(
    out: &Bound<'py, PyAny>,
    dtype: &str,
) -> PyResult<numpy::PyReadwriteArray2<'py, T>> {
    out.cast::<PyArray2<T>>()
        .map_err(|_| PyTypeError::new_err(format!("out must be a 2-D {dtype} numpy array")))?
        .try_readwrite()
        .map_err(|e| {
            PyValueError::new_err(format!(
                "out must be writeable and share no memory with the call's other arrays ({e})"
            ))
        })
}

/// `(elements, bytes)` of one block of ggml type `qtype`; ValueError for a type the kernels do
/// not take.
#[pyfunction]
fn cpu_quant_block_shape(qtype: u32) -> PyResult<(usize, usize)> {
    Ok(QType::from_code(qtype)?.block())
}

/// `out [M, N] = x [M, K] @ W.T (+ bias [N])` for the weight of `segments` (`K` =
/// `in_features` = x's columns); float32, contiguous; `num_threads` workers at most;
/// `activations`: "f32", or decode rows by 8- or 16-bit activations and integer dots ("int8",
/// "int16": `Activations::Int8` / `Int16`).
#[pyfunction]
#[pyo3(signature = (x, segments, bias, out, num_threads, activations="f32"))]
fn cpu_quant_linear(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    segments: Segments<'_>,
    bias: Option<PyReadonlyArray1<'_, f32>>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
    activations: &str,
) -> PyResult<()> {
    let activations = activations_named(activations)?;
    let w = matrix(&segments, x.shape()[1])?;
    let bias = bias
        .as_ref()
        .map(|b| {
            b.as_slice()
                .map_err(|_| PyValueError::new_err("bias must be contiguous"))
        })
        .transpose()?;
    let mut out = writeable::<f32>(out, "float32")?;
    let (x, out) = (x.as_array(), out.as_array_mut());
    py.detach(|| quant::quant_linear_with(x, &w, bias, out, num_threads, activations))?;
    Ok(())
}

/// The weight of `segments` as float32 into `out [N, K]`.
#[pyfunction]
fn cpu_quant_dequantize(
    py: Python<'_>,
    segments: Segments<'_>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut out = writeable::<f32>(out, "float32")?;
    let w = matrix(&segments, out.shape()[1])?;
    let out = out.as_array_mut();
    py.detach(|| quant::dequantize(&w, out))?;
    Ok(())
}

/// Rows `ids` (int64) of the weight of `segments` as float32 into `out [len(ids), K]`.
#[pyfunction]
fn cpu_quant_embedding(
    py: Python<'_>,
    ids: PyReadonlyArray1<'_, i64>,
    segments: Segments<'_>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut out = writeable::<f32>(out, "float32")?;
    let w = matrix(&segments, out.shape()[1])?;
    let ids = ids
        .as_slice()
        .map_err(|_| PyValueError::new_err("ids must be contiguous"))?;
    let out = out.as_array_mut();
    py.detach(|| quant::embedding(&w, ids, out))?;
    Ok(())
}

/// float32 `weight [N, K]` quantized to ggml type `qtype` (Q8_0 or Q4_0) into uint8
/// `out [N, row_bytes]`, rounded as ggml's reference quantizers.
#[pyfunction]
fn cpu_quant_quantize(
    py: Python<'_>,
    weight: PyReadonlyArray2<'_, f32>,
    qtype: u32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let t = QType::from_code(qtype)?;
    let mut out = writeable::<u8>(out, "uint8")?;
    let (weight, out) = (weight.as_array(), out.as_array_mut());
    py.detach(|| quant::quantize(weight, t, out))?;
    Ok(())
}

/// uint8 rows `src` `[rows, row_bytes]` of ggml type `qtype` (`in_features` elements a row)
/// written into `out` (as many bytes) in the layout this process's products read fastest
/// (`quant::repack`), returning that layout's type code; None, `out` untouched, where the type
/// stays as it is.
#[pyfunction]
fn cpu_quant_repack(
    py: Python<'_>,
    qtype: u32,
    src: PyReadonlyArray2<'_, u8>,
    in_features: usize,
    out: &Bound<'_, PyAny>,
) -> PyResult<Option<u32>> {
    let t = QType::from_code(qtype)?;
    if !quant::repack::repacks(t) {
        return Ok(None);
    }
    let mut out = writeable::<u8>(out, "uint8")?;
    let src = src
        .as_slice()
        .map_err(|_| PyValueError::new_err("src must be contiguous"))?;
    let dst = out
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("out must be contiguous"))?;
    let to = py.detach(|| quant::repack::repack(t, src, dst, in_features))?;
    Ok(Some(to as u32))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_quant_block_shape, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_linear, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_embedding, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_quant_repack, m)?)?;
    Ok(())
}
