//! The grouped mixture-of-experts kernel (`crate::cpu::moe_experts`) for the model runner: torch
//! CPU tensors as numpy views (bfloat16 as its uint16 bits, `cpu_ops`'s rule), the kernel run
//! with the GIL released. Quantized experts (`CpuMoeQuantExperts`) are registered once as two
//! byte buffers and their layout.
use std::sync::Arc;

use numpy::{
    PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::cpu_ops::{readonly, readwrite, view, view_mut, Dtype, Kind};
use super::cpu_quant::activations_named;
use crate::cpu;
use crate::cpu::quant::QType;

/// `out [T, H]` = each token's experts' SwiGLU outputs weighted by the router and summed, for x
/// `[T, H]`, the stacked gate/up panels `[E, ceil(2I / 16), H, 16]` and down panels
/// `[E, ceil(H / 16), I, 16]` (x, the panels and out all float32, or all bfloat16 as uint16),
/// int64 expert ids and float32 weights `[T, k]`; all contiguous; `num_threads` workers at most.
#[pyfunction]
#[pyo3(signature = (x, gate_up, down, ids, weights, out, num_threads))]
#[allow(clippy::too_many_arguments)]
fn cpu_moe_experts(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    gate_up: &Bound<'_, PyAny>,
    down: &Bound<'_, PyAny>,
    ids: PyReadonlyArray2<'_, i64>,
    weights: PyReadonlyArray2<'_, f32>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let routing = (ids, weights);
    match Kind::of("x", x)? {
        Kind::F32 => experts::<f32>(py, (x, gate_up, down, out), routing, num_threads),
        Kind::Bf16 => experts::<u16>(py, (x, gate_up, down, out), routing, num_threads),
    }
}

type ExpertArrays<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
);

fn experts<N: Dtype>(
    py: Python<'_>,
    (x, gate_up, down, out): ExpertArrays<'_, '_>,
    (ids, weights): (PyReadonlyArray2<'_, i64>, PyReadonlyArray2<'_, f32>),
    num_threads: usize,
) -> PyResult<()> {
    let x = readonly::<N, ndarray::Ix2>("x", x)?;
    let gate_up = readonly::<N, ndarray::Ix4>("gate_up", gate_up)?;
    let down = readonly::<N, ndarray::Ix4>("down", down)?;
    let mut out: PyReadwriteArray2<'_, N> = readwrite::<N, ndarray::Ix2>("out", out)?;
    let (x, gate_up, down) = (
        view(x.as_array()),
        view(gate_up.as_array()),
        view(down.as_array()),
    );
    let (ids, weights) = (ids.as_array(), weights.as_array());
    let out = view_mut(out.as_array_mut());
    py.detach(|| cpu::moe_experts(x, gate_up, down, ids, weights, out, num_threads))?;
    Ok(())
}

/// Experts kept in their GGUF types, registered once (`cpu_moe.QuantExperts`): every expert's
/// gate/up and down row segments in two uint8 buffers (`cpu::QuantLayout`), so that a call
/// borrows two arrays (a segment array per expert and projection borrowed per call cost ~7 % of
/// a Q8_0 decode step at 64 experts a layer).
#[pyclass(frozen, module = "pagedllm._core")]
pub struct CpuMoeQuantExperts {
    gate_up: Py<PyArray1<u8>>,
    down: Py<PyArray1<u8>>,
    layout: Arc<cpu::QuantLayout>,
}

/// A projection's segments per expert `(ggml type code, rows)` as the layout takes them.
fn parts(experts: Vec<Vec<(u32, usize)>>) -> PyResult<Vec<Vec<(QType, usize)>>> {
    experts
        .into_iter()
        .map(|segments| {
            segments
                .into_iter()
                .map(|(code, rows)| Ok((QType::from_code(code)?, rows)))
                .collect()
        })
        .collect()
}

/// The borrowed buffers of one call.
pub(crate) struct HeldBytes<'py> {
    gate_up: PyReadonlyArray1<'py, u8>,
    down: PyReadonlyArray1<'py, u8>,
    layout: Arc<cpu::QuantLayout>,
}

impl HeldBytes<'_> {
    /// The experts over the borrowed buffers.
    pub(crate) fn view(&self) -> PyResult<cpu::QuantExperts<'_>> {
        let contiguous = |_| PyValueError::new_err("the experts' bytes must be contiguous");
        let gate_up = self.gate_up.as_slice().map_err(contiguous)?;
        let down = self.down.as_slice().map_err(contiguous)?;
        Ok(self.layout.over(gate_up, down)?)
    }
}

impl CpuMoeQuantExperts {
    /// The two buffers borrowed for one call (the one-call decoder's too).
    pub(crate) fn borrow<'py>(&self, py: Python<'py>) -> PyResult<HeldBytes<'py>> {
        let read = |a: &Py<PyArray1<u8>>| {
            a.bind(py).try_readonly().map_err(|e| {
                PyValueError::new_err(format!("the experts' weights are borrowed: {e}"))
            })
        };
        Ok(HeldBytes {
            gate_up: read(&self.gate_up)?,
            down: read(&self.down)?,
            layout: Arc::clone(&self.layout),
        })
    }
}

#[pymethods]
impl CpuMoeQuantExperts {
    /// `gate_up_bytes` / `down_bytes`: uint8 buffers holding every expert's gate/up (`[2I, H]`,
    /// gate rows then up rows) and down (`[H, I]`) rows back to back, expert after expert;
    /// `gate_up[e]` / `down[e]`: expert `e`'s segments there as `(ggml type code, rows)`;
    /// `hidden` = H. A ValueError for an unsupported type, shapes that do not fit together or
    /// buffers not the segments' size.
    #[new]
    fn new(
        gate_up_bytes: Bound<'_, PyArray1<u8>>,
        gate_up: Vec<Vec<(u32, usize)>>,
        down_bytes: Bound<'_, PyArray1<u8>>,
        down: Vec<Vec<(u32, usize)>>,
        hidden: usize,
    ) -> PyResult<Self> {
        let py = gate_up_bytes.py();
        let layout = cpu::QuantLayout::new(&parts(gate_up)?, &parts(down)?, hidden)?;
        let held = Self {
            gate_up: gate_up_bytes.unbind(),
            down: down_bytes.unbind(),
            layout: Arc::new(layout),
        };
        held.borrow(py)?.view()?; // the buffers' sizes and contiguity checked once here
        Ok(held)
    }

    /// `cpu_moe_experts` for float32 x `[T, H]` over these experts: int64 ids (in `0..E`, or
    /// -1: skipped) and float32 weights `[T, k]`, out `[T, H]`; the products multiply x as
    /// `activations` ("f32", "int8", "int16") says.
    #[pyo3(signature = (x, ids, weights, out, num_threads, activations="f32"))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        x: PyReadonlyArray2<'_, f32>,
        ids: PyReadonlyArray2<'_, i64>,
        weights: PyReadonlyArray2<'_, f32>,
        mut out: PyReadwriteArray2<'_, f32>,
        num_threads: usize,
        activations: &str,
    ) -> PyResult<()> {
        let activations = activations_named(activations)?;
        if x.shape()[1] != self.layout.hidden() {
            return Err(PyValueError::new_err(format!(
                "x has {} columns, the experts take {}",
                x.shape()[1],
                self.layout.hidden()
            )));
        }
        let held = self.borrow(py)?;
        let experts = held.view()?;
        let (x, ids, weights) = (x.as_array(), ids.as_array(), weights.as_array());
        let out = out.as_array_mut();
        py.detach(|| {
            cpu::moe_quant_experts(x, &experts, ids, weights, out, num_threads, activations)
        })?;
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_moe_experts, m)?)?;
    m.add_class::<CpuMoeQuantExperts>()?;
    Ok(())
}
