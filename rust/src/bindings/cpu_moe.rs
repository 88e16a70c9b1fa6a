//! The grouped mixture-of-experts kernel (`crate::cpu::moe_experts`) for the model runner: torch
//! CPU tensors as numpy views (bfloat16 as its uint16 bits, `cpu_ops`'s rule), the kernel run
//! with the GIL released. Quantized experts (`CpuMoeQuantExperts`) are registered once as a few
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
/// gate/up and down row segments placed in a few uint8 buffers (`cpu::QuantLayout`: the GGUF
/// file's mapped expert tensors as they are, or one copy), so that a call borrows those few
/// arrays (a segment array per expert and projection borrowed per call cost ~7 % of a Q8_0
/// decode step at 64 experts a layer).
#[pyclass(frozen, module = "pagedllm._core")]
pub struct CpuMoeQuantExperts {
    buffers: Vec<Py<PyArray1<u8>>>,
    layout: Arc<cpu::QuantLayout>,
    /// What owns the buffers' memory where they are views (kept alive as long as the experts).
    _owners: Py<PyAny>,
}

/// A projection's segments per expert `(ggml type code, rows, buffer, byte offset)` as the
/// layout takes them.
fn placed(experts: Vec<Vec<(u32, usize, usize, usize)>>) -> PyResult<Vec<Vec<cpu::moe::Placed>>> {
    experts
        .into_iter()
        .map(|segments| {
            segments
                .into_iter()
                .map(|(code, rows, buffer, offset)| {
                    Ok(cpu::moe::Placed {
                        qtype: QType::from_code(code)?,
                        rows,
                        buffer,
                        offset,
                    })
                })
                .collect()
        })
        .collect()
}

/// The borrowed buffers of one call.
pub(crate) struct HeldBytes<'py> {
    buffers: Vec<PyReadonlyArray1<'py, u8>>,
    layout: Arc<cpu::QuantLayout>,
}

impl HeldBytes<'_> {
    /// The experts over the borrowed buffers.
    pub(crate) fn view(&self) -> PyResult<cpu::QuantExperts<'_>> {
        let buffers = self
            .buffers
            .iter()
            .map(|b| {
                b.as_slice()
                    .map_err(|_| PyValueError::new_err("the experts' bytes must be contiguous"))
            })
            .collect::<PyResult<Vec<&[u8]>>>()?;
        Ok(self.layout.over(buffers)?)
    }
}

impl CpuMoeQuantExperts {
    /// The buffers borrowed for one call (the one-call decoder's too).
    pub(crate) fn borrow<'py>(&self, py: Python<'py>) -> PyResult<HeldBytes<'py>> {
        let buffers = self
            .buffers
            .iter()
            .map(|a| {
                a.bind(py).try_readonly().map_err(|e| {
                    PyValueError::new_err(format!("the experts' weights are borrowed: {e}"))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(HeldBytes {
            buffers,
            layout: Arc::clone(&self.layout),
        })
    }
}

#[pymethods]
impl CpuMoeQuantExperts {
    /// `buffers`: 1-D uint8 arrays; `gate_up[e]` / `down[e]`: expert `e`'s gate/up (`[2I, H]`,
    /// gate rows then up rows) and down (`[H, I]`) row segments as `(ggml type code, rows,
    /// buffer index, byte offset)`; `hidden` = H; `owners`: kept alive as long as the experts
    /// (what owns the buffers' memory). A ValueError for an unsupported type, shapes that do not
    /// fit together or a segment outside its buffer.
    #[new]
    #[pyo3(signature = (buffers, gate_up, down, hidden, owners=None))]
    fn new(
        py: Python<'_>,
        buffers: Vec<Bound<'_, PyArray1<u8>>>,
        gate_up: Vec<Vec<(u32, usize, usize, usize)>>,
        down: Vec<Vec<(u32, usize, usize, usize)>>,
        hidden: usize,
        owners: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let sizes: Vec<usize> = buffers.iter().map(|b| b.len()).collect();
        let layout = cpu::QuantLayout::new(&sizes, &placed(gate_up)?, &placed(down)?, hidden)?;
        let held = Self {
            buffers: buffers.into_iter().map(Bound::unbind).collect(),
            layout: Arc::new(layout),
            _owners: owners.unwrap_or_else(|| py.None()),
        };
        held.borrow(py)?.view()?; // the buffers' contiguity checked once here
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
