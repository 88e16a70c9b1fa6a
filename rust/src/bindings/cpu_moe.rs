//! The grouped mixture-of-experts kernel (`crate::cpu::moe_experts`) for the model runner: torch
//! CPU tensors as numpy views (bfloat16 as its uint16 bits, `cpu_ops`'s rule), the kernel run
//! with the GIL released. Quantized experts (`CpuMoeQuantExperts`) are registered once as
//! `cpu_quant`'s segments, one list per expert and projection.
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::cpu_ops::{readonly, readwrite, view, view_mut, Dtype, Kind};
use super::cpu_quant::{activations_named, matrix, Segments};
use crate::cpu;
use crate::cpu::quant::QuantMatrix;

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

/// One expert's projection: its segments' `(ggml type code, uint8 [rows, row_bytes])` arrays.
type HeldSegments = Vec<(u32, Py<PyArray2<u8>>)>;

/// Experts kept in their GGUF types, registered once (`cpu_moe.QuantExperts`): the segments'
/// arrays held, so that a step's call passes only x, the routing and out (extracting every
/// expert's segments from Python lists on each call cost ~165 µs a layer at 64 experts).
#[pyclass(frozen, module = "pagedllm._core")]
pub struct CpuMoeQuantExperts {
    gate_up: Vec<HeldSegments>,
    down: Vec<HeldSegments>,
    hidden: usize,
    width: usize,
}

fn held(segments: &[Segments<'_>]) -> Vec<HeldSegments> {
    segments
        .iter()
        .map(|s| {
            s.iter()
                .map(|(code, a)| (*code, a.as_unbound().clone_ref(a.py())))
                .collect()
        })
        .collect()
}

/// Borrows the arrays of the experts `chosen` marks for one call (`cpu_quant::matrix`'s
/// segments; None for the others, which the call does not read).
fn borrowed<'py>(
    py: Python<'py>,
    experts: &[HeldSegments],
    chosen: &[bool],
) -> PyResult<Vec<Option<Segments<'py>>>> {
    experts
        .iter()
        .zip(chosen)
        .map(|(s, &chosen)| {
            if !chosen {
                return Ok(None);
            }
            s.iter()
                .map(|(code, a)| {
                    let array = a.bind(py).try_readonly().map_err(|e| {
                        PyValueError::new_err(format!("an expert's weight is borrowed: {e}"))
                    })?;
                    Ok((*code, array))
                })
                .collect::<PyResult<Segments<'py>>>()
                .map(Some)
        })
        .collect()
}

/// The held experts' weights of one call: only those some id names.
fn matrices<'a>(
    segments: &'a [Option<Segments<'_>>],
    in_features: usize,
) -> PyResult<Vec<Option<QuantMatrix<'a>>>> {
    segments
        .iter()
        .map(|s| s.as_ref().map(|s| matrix(s, in_features)).transpose())
        .collect()
}

impl CpuMoeQuantExperts {
    /// Every expert's segments borrowed (the one-call decoder's routing runs without the GIL,
    /// so all experts are lent to it), and H and I.
    #[allow(clippy::type_complexity)]
    pub(crate) fn borrow_all<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Vec<Segments<'py>>, Vec<Segments<'py>>, usize, usize)> {
        let all = vec![true; self.gate_up.len()];
        let every = |experts| -> PyResult<Vec<Segments<'py>>> {
            Ok(borrowed(py, experts, &all)?.into_iter().flatten().collect())
        };
        Ok((
            every(&self.gate_up)?,
            every(&self.down)?,
            self.hidden,
            self.width,
        ))
    }
}

#[pymethods]
impl CpuMoeQuantExperts {
    /// `gate_up[e]` (`[2I, H]`, gate rows then up rows) and `down[e]` (`[H, I]`): expert `e`'s
    /// `(ggml type code, uint8 [rows, row_bytes])` segments; `hidden` = H. Types and row
    /// sizes checked here, the experts' shapes by each call.
    #[new]
    fn new(gate_up: Vec<Segments<'_>>, down: Vec<Segments<'_>>, hidden: usize) -> PyResult<Self> {
        let gate_up_m = gate_up
            .iter()
            .map(|segments| matrix(segments, hidden))
            .collect::<PyResult<Vec<_>>>()?;
        let width = gate_up_m.first().map_or(0, |w| w.n() / 2);
        let down_m = down
            .iter()
            .map(|segments| matrix(segments, width))
            .collect::<PyResult<Vec<_>>>()?;
        drop((gate_up_m, down_m));
        Ok(Self {
            gate_up: held(&gate_up),
            down: held(&down),
            hidden,
            width,
        })
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
        if x.shape()[1] != self.hidden {
            return Err(PyValueError::new_err(format!(
                "x has {} columns, the experts take {}",
                x.shape()[1],
                self.hidden
            )));
        }
        // an id outside 0..E marks nothing here: the kernel names it in its error
        let mut chosen = vec![false; self.gate_up.len()];
        for &id in ids.as_array().iter() {
            if let Some(c) = usize::try_from(id).ok().and_then(|e| chosen.get_mut(e)) {
                *c = true;
            }
        }
        let gate_up = borrowed(py, &self.gate_up, &chosen)?;
        let down = borrowed(py, &self.down, &chosen)?;
        let gate_up = matrices(&gate_up, self.hidden)?;
        let down = matrices(&down, self.width)?;
        let gate_up: Vec<Option<&QuantMatrix<'_>>> = gate_up.iter().map(Option::as_ref).collect();
        let down: Vec<Option<&QuantMatrix<'_>>> = down.iter().map(Option::as_ref).collect();
        let (x, ids, weights) = (x.as_array(), ids.as_array(), weights.as_array());
        let out = out.as_array_mut();
        py.detach(|| {
            cpu::moe_quant_chosen(
                x,
                (&gate_up, &down),
                ids,
                weights,
                out,
                num_threads,
                activations,
            )
        })?;
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_moe_experts, m)?)?;
    m.add_class::<CpuMoeQuantExperts>()?;
    Ok(())
}
