//! `CpuDecoder`: a model's layer weights held once (numpy arrays: `linear`'s panels or a GGUF
//! weight's segments), and `forward`, the whole decoder over one step in one call with the GIL
//! released (`crate::cpu::forward`).
use numpy::ndarray::{Array2, ArrayViewMut2, Ix6};
use numpy::{
    PyArray, PyArray1, PyArray2, PyArray3, PyArray4, PyArrayMethods, PyReadonlyArray1,
    PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray1, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::cpu_moe::{CpuMoeQuantExperts, HeldBytes};
use super::cpu_ops::{FloatKv, Fp8E4M3Kv, Fp8E5M2Kv, Int8Kv, KvDtype, KvFormat};
use super::cpu_quant::{matrix, Segments};
use crate::cpu::attention::PagedBatch;
use crate::cpu::forward::{
    self, Embedding, Experts, KeyTransform, Layer, Linear, Mlp, MoeMlp, Options, Shape,
    SharedExpert, Step, Weight,
};
use crate::cpu::quant::{QType, QuantMatrix, Segment};
use crate::cpu::views::cast_view_mut;

/// A projection's arrays: panels of `n` outputs, or ggml segments of rows of `k` elements.
enum WeightArrays {
    Panels(Py<PyArray3<f32>>, usize),
    Quant(Vec<HeldSegment>, usize),
}

/// One ggml segment: its type code and rows, and where it lies in one of the decoder's
/// `buffers` if it does (then read from the buffer's one borrow a call, not borrowed itself:
/// numpy's borrow check costs ~1 us an array, ~2 % of a small model's decode step).
struct HeldSegment {
    code: u32,
    array: Py<PyArray2<u8>>,
    /// (buffer, byte offset, bytes, rows)
    place: Option<(usize, usize, usize, usize)>,
}

impl HeldSegment {
    /// Its place in one of `buffers` (address, bytes) where it lies wholly inside one.
    fn place_in(&mut self, py: Python<'_>, buffers: &[(usize, usize)]) {
        let array = self.array.bind(py);
        if !array.is_c_contiguous() {
            return;
        }
        let (start, len) = (array.data() as usize, array.len());
        self.place = buffers
            .iter()
            .position(|&(b, n)| b <= start && start + len <= b + n)
            .map(|i| (i, start - buffers[i].0, len, array.shape()[0]));
    }
}

/// A segment borrowed for a call: the array itself, or its place in a borrowed buffer.
enum SegmentGuard<'py> {
    Own(u32, PyReadonlyArray2<'py, u8>),
    Placed(u32, (usize, usize, usize, usize)),
}

/// The kernels' weight over `segments` (`cpu_quant::matrix`), placed ones sliced from `bufs`.
fn placed_matrix<'a>(
    segments: &'a [SegmentGuard<'_>],
    k: usize,
    bufs: &[&'a [u8]],
) -> PyResult<QuantMatrix<'a>> {
    let parts = segments
        .iter()
        .enumerate()
        .map(|(i, segment)| -> PyResult<Segment<'a>> {
            let (code, data, rows) = match segment {
                SegmentGuard::Own(code, a) => {
                    let data = a.as_slice().map_err(|_| {
                        PyValueError::new_err(format!("segment {i}'s bytes must be contiguous"))
                    })?;
                    (*code, data, a.shape()[0])
                }
                SegmentGuard::Placed(code, (b, offset, len, rows)) => {
                    let data = bufs
                        .get(*b)
                        .and_then(|buf| buf.get(*offset..*offset + *len))
                        .ok_or_else(|| {
                            PyValueError::new_err(format!("segment {i} is outside its buffer"))
                        })?;
                    (*code, data, *rows)
                }
            };
            Ok(Segment {
                qtype: QType::from_code(code)?,
                data,
                rows,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(QuantMatrix::new(parts, k)?)
}

struct LinearArrays {
    weight: WeightArrays,
    bias: Option<Py<PyArray1<f32>>>,
}

/// A norm weight or a bias, held.
type Vector = Py<PyArray1<f32>>;

struct LayerArrays {
    input_norm: Vector,
    qkv: LinearArrays,
    qk_norm: Option<(Vector, Vector)>,
    o: LinearArrays,
    post_norm: Py<PyArray1<f32>>,
    mlp: MlpArrays,
    /// query scale, key scale, key offset, key feedback (`models/cpu_forward.py`'s
    /// `_key_transform`)
    key_transform: Option<KeyArrays>,
}

enum MlpArrays {
    Dense {
        gate_up: LinearArrays,
        down: LinearArrays,
    },
    Moe(MoeArrays),
}

/// A sparse layer's MLP (`models/cpu_forward.py`'s `_moe`).
struct MoeArrays {
    router: LinearArrays,
    experts: ExpertArrays,
    top_k: usize,
    normalize: bool,
    /// gate_up, down, gate
    shared: Option<(LinearArrays, LinearArrays, LinearArrays)>,
    /// the block's `expert_tokens` `[E]`, added to in place
    counts: Py<PyArray1<i64>>,
}

enum ExpertArrays {
    /// stacked gate/up and down panels
    Panels(Py<PyArray4<f32>>, Py<PyArray4<f32>>),
    Quant(Py<CpuMoeQuantExperts>),
}

/// The token embedding `logits` reads its rows from.
enum EmbeddingArrays {
    /// float32 `[V, E]`
    Table(Py<PyArray2<f32>>),
    /// ggml segments of rows of `k` elements
    Quant(Vec<(u32, Py<PyArray2<u8>>)>, usize),
}

/// A decoder's weights for `forward` (see `models/cpu_forward.py`, which builds it).
#[pyclass(frozen, module = "pagedllm._core")]
pub struct CpuDecoder {
    layers: Vec<LayerArrays>,
    final_norm: Py<PyArray1<f32>>,
    shape: Shape,
    /// the embedding and the LM head, both or neither: `logits` runs only with them
    ends: Option<(EmbeddingArrays, LinearArrays)>,
    /// uint8 buffers holding quantized segments (the huge-page weight buffer): each borrowed
    /// once a call, the segments in them sliced from it (`HeldSegment`)
    buffers: Vec<Py<PyArray1<u8>>>,
}

/// The decoder's buffers borrowed for a call.
fn borrow_buffers<'py>(
    py: Python<'py>,
    buffers: &[Py<PyArray1<u8>>],
) -> Vec<PyReadonlyArray1<'py, u8>> {
    buffers.iter().map(|b| b.bind(py).readonly()).collect()
}

fn buffer_slices<'a>(held: &'a [PyReadonlyArray1<'_, u8>]) -> PyResult<Vec<&'a [u8]>> {
    held.iter()
        .map(|b| {
            b.as_slice()
                .map_err(|_| PyValueError::new_err("a weight buffer is not contiguous"))
        })
        .collect()
}

/// `("table", float32 [V, E])` or `("quant", [(type, uint8 [rows, bytes])], k)`.
fn embedding_arrays(spec: &Bound<'_, PyAny>) -> PyResult<EmbeddingArrays> {
    let parts = spec
        .cast::<PyTuple>()
        .map_err(|_| PyTypeError::new_err("embedding must be a tuple"))?;
    let kind: String = parts.get_item(0)?.extract()?;
    match (kind.as_str(), parts.len()) {
        ("table", 2) => {
            let table = parts.get_item(1)?;
            let table = table.cast::<PyArray2<f32>>().map_err(|_| {
                PyTypeError::new_err("the embedding table must be a 2-D float32 array")
            })?;
            Ok(EmbeddingArrays::Table(table.clone().unbind()))
        }
        ("quant", 3) => {
            let segments: Vec<(u32, Bound<'_, PyArray2<u8>>)> =
                parts.get_item(1)?.extract().map_err(|_| {
                    PyTypeError::new_err("the embedding's segments must be (type, uint8 2-D) pairs")
                })?;
            let segments = segments.into_iter().map(|(t, a)| (t, a.unbind())).collect();
            Ok(EmbeddingArrays::Quant(
                segments,
                parts.get_item(2)?.extract()?,
            ))
        }
        _ => Err(PyValueError::new_err(
            "embedding must be ('table', float32 [V, E]) or ('quant', segments, k)",
        )),
    }
}

/// The embedding's arrays borrowed for a call.
enum EmbeddingGuard<'py> {
    Table(PyReadonlyArray2<'py, f32>),
    Quant(Segments<'py>, usize),
}

impl EmbeddingArrays {
    fn borrow<'py>(&self, py: Python<'py>) -> EmbeddingGuard<'py> {
        match self {
            EmbeddingArrays::Table(t) => EmbeddingGuard::Table(t.bind(py).readonly()),
            EmbeddingArrays::Quant(segments, k) => EmbeddingGuard::Quant(
                segments
                    .iter()
                    .map(|(t, a)| (*t, a.bind(py).readonly()))
                    .collect(),
                *k,
            ),
        }
    }
}

impl EmbeddingGuard<'_> {
    fn view(&self) -> PyResult<Embedding<'_>> {
        Ok(match self {
            EmbeddingGuard::Table(t) => Embedding::Table(t.as_array()),
            EmbeddingGuard::Quant(segments, k) => Embedding::Quant(matrix(segments, *k)?),
        })
    }
}

fn array1(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Py<PyArray1<f32>>> {
    let array = obj
        .cast::<PyArray1<f32>>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a 1-D float32 array")))?;
    if !array.is_contiguous() {
        return Err(PyValueError::new_err(format!("{what} must be contiguous")));
    }
    Ok(array.clone().unbind())
}

/// `("panels", float32 [P, K, 16], n, bias)` or `("quant", [(type, uint8 [rows, bytes])], k,
/// bias)`; bias None or float32 `[N]`.
fn linear_arrays(spec: &Bound<'_, PyAny>, what: &str) -> PyResult<LinearArrays> {
    let (kind, weight, size, bias): (String, Bound<'_, PyAny>, usize, Option<Bound<'_, PyAny>>) =
        spec.extract().map_err(|_| {
            PyTypeError::new_err(format!("{what} must be (kind, weight, size, bias)"))
        })?;
    let weight = match kind.as_str() {
        "panels" => {
            let panels = weight.cast::<PyArray3<f32>>().map_err(|_| {
                PyTypeError::new_err(format!("{what}'s panels must be a 3-D float32 array"))
            })?;
            WeightArrays::Panels(panels.clone().unbind(), size)
        }
        "quant" => {
            let segments: Vec<(u32, Bound<'_, PyArray2<u8>>)> = weight.extract().map_err(|_| {
                PyTypeError::new_err(format!("{what}'s segments must be (type, uint8 2-D) pairs"))
            })?;
            let segments = segments
                .into_iter()
                .map(|(code, a)| HeldSegment {
                    code,
                    array: a.unbind(),
                    place: None,
                })
                .collect();
            WeightArrays::Quant(segments, size)
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "{what}: kind {other:?} is neither 'panels' nor 'quant'"
            )))
        }
    };
    let bias = bias
        .map(|b| array1(&b, &format!("{what}'s bias")))
        .transpose()?;
    Ok(LinearArrays { weight, bias })
}

fn layer_arrays(spec: &Bound<'_, PyAny>, i: usize) -> PyResult<LayerArrays> {
    let parts = spec
        .cast::<PyTuple>()
        .map_err(|_| PyTypeError::new_err(format!("layer {i} must be a tuple of 8 parts")))?;
    if parts.len() != 8 {
        return Err(PyValueError::new_err(format!(
            "layer {i} has {} parts; expected (input_norm, qkv, q_norm, k_norm, o, post_norm, \
             gate_up, down)",
            parts.len()
        )));
    }
    let part = |j: usize| parts.get_item(j);
    let name = |what: &str| format!("layer {i}'s {what}");
    let (q_norm, k_norm) = (part(2)?, part(3)?);
    let qk_norm = match (q_norm.is_none(), k_norm.is_none()) {
        (true, true) => None,
        (false, false) => Some((
            array1(&q_norm, &name("q_norm"))?,
            array1(&k_norm, &name("k_norm"))?,
        )),
        _ => {
            return Err(PyValueError::new_err(format!(
                "layer {i}: q_norm and k_norm come together"
            )))
        }
    };
    let mlp = if part(7)?.is_none() {
        MlpArrays::Moe(moe_arrays(&part(6)?, &name("moe"))?)
    } else {
        MlpArrays::Dense {
            gate_up: linear_arrays(&part(6)?, &name("gate_up"))?,
            down: linear_arrays(&part(7)?, &name("down"))?,
        }
    };
    Ok(LayerArrays {
        input_norm: array1(&part(0)?, &name("input_norm"))?,
        qkv: linear_arrays(&part(1)?, &name("qkv"))?,
        qk_norm,
        o: linear_arrays(&part(4)?, &name("o"))?,
        post_norm: array1(&part(5)?, &name("post_norm"))?,
        mlp,
        key_transform: None,
    })
}

type KeyArrays = (Vector, Vector, Option<Vector>, Option<Vector>);

/// `(query_scale [H·D], key_scale [KVH·D], key_offset [KVH·D] or None, key_feedback
/// [KVH·D·D] or None)`, float32.
fn key_transform_arrays(spec: &Bound<'_, PyAny>, i: usize) -> PyResult<KeyArrays> {
    let what = format!("layer {i}'s key transform");
    type Spec<'py> = (
        Bound<'py, PyAny>,
        Bound<'py, PyAny>,
        Option<Bound<'py, PyAny>>,
        Option<Bound<'py, PyAny>>,
    );
    let (q, k, c, f): Spec<'_> = spec.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be (query_scale, key_scale, key_offset or None, key_feedback or None)"
        ))
    })?;
    let optional = |a: Option<Bound<'_, PyAny>>, name: &str| {
        a.map(|a| array1(&a, &format!("{what}'s {name}")))
            .transpose()
    };
    Ok((
        array1(&q, &format!("{what}'s query_scale"))?,
        array1(&k, &format!("{what}'s key_scale"))?,
        optional(c, "key_offset")?,
        optional(f, "key_feedback")?,
    ))
}

/// `("moe", router, experts, top_k, normalize, shared, counts)`: router a linear spec, experts
/// `("panels", float32 gate_up [E, P, H, 16], float32 down [E, P, I, 16])` or `("quant",
/// CpuMoeQuantExperts)`, shared None or `(gate_up, down, gate)` linear specs, counts int64 `[E]`.
fn moe_arrays(spec: &Bound<'_, PyAny>, what: &str) -> PyResult<MoeArrays> {
    type Spec<'py> = (
        String,
        Bound<'py, PyAny>,
        Bound<'py, PyTuple>,
        usize,
        bool,
        Option<Bound<'py, PyTuple>>,
        Bound<'py, PyAny>,
    );
    let (kind, router, experts, top_k, normalize, shared, counts): Spec<'_> =
        spec.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be ('moe', router, experts, top_k, normalize, shared, counts)"
            ))
        })?;
    if kind != "moe" {
        return Err(PyValueError::new_err(format!(
            "{what}: kind {kind:?} is not 'moe' (a dense layer gives gate_up and down)"
        )));
    }
    let experts_kind: String = experts.get_item(0)?.extract()?;
    let experts = match experts_kind.as_str() {
        "panels" if experts.len() == 3 => {
            let panels = |j: usize| -> PyResult<Py<PyArray4<f32>>> {
                let item = experts.get_item(j)?;
                let array = item.cast::<PyArray4<f32>>().map_err(|_| {
                    PyTypeError::new_err(format!("{what}'s expert panels must be 4-D float32"))
                })?;
                Ok(array.clone().unbind())
            };
            ExpertArrays::Panels(panels(1)?, panels(2)?)
        }
        "quant" if experts.len() == 2 => {
            let held = experts.get_item(1)?;
            let held = held.cast::<CpuMoeQuantExperts>().map_err(|_| {
                PyTypeError::new_err(format!("{what}'s quantized experts must be a CpuMoeQuantExperts"))
            })?;
            ExpertArrays::Quant(held.clone().unbind())
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "{what}: experts ({other:?}, ...) are neither ('panels', gate_up, down) nor                  ('quant', CpuMoeQuantExperts)"
            )))
        }
    };
    let shared = shared
        .map(|parts| -> PyResult<_> {
            let part = |j: usize, name: &str| {
                linear_arrays(&parts.get_item(j)?, &format!("{what}'s shared {name}"))
            };
            Ok((part(0, "gate_up")?, part(1, "down")?, part(2, "gate")?))
        })
        .transpose()?;
    let counts = counts
        .cast::<PyArray1<i64>>()
        .map_err(|_| PyTypeError::new_err(format!("{what}'s counts must be a 1-D int64 array")))?
        .clone()
        .unbind();
    Ok(MoeArrays {
        router: linear_arrays(&router, &format!("{what}'s router"))?,
        experts,
        top_k,
        normalize,
        shared,
        counts,
    })
}

/// The arrays of one projection borrowed for a call.
enum WeightGuard<'py> {
    Panels(PyReadonlyArray3<'py, f32>, usize),
    Quant(Vec<SegmentGuard<'py>>, usize),
}

struct LinearGuard<'py> {
    weight: WeightGuard<'py>,
    bias: Option<PyReadonlyArray1<'py, f32>>,
}

struct LayerGuard<'py> {
    input_norm: PyReadonlyArray1<'py, f32>,
    qkv: LinearGuard<'py>,
    qk_norm: Option<(PyReadonlyArray1<'py, f32>, PyReadonlyArray1<'py, f32>)>,
    o: LinearGuard<'py>,
    post_norm: PyReadonlyArray1<'py, f32>,
    mlp: MlpGuard<'py>,
    key_transform: Option<KeyGuard<'py>>,
}

type KeyGuard<'py> = (
    PyReadonlyArray1<'py, f32>,
    PyReadonlyArray1<'py, f32>,
    Option<PyReadonlyArray1<'py, f32>>,
    Option<PyReadonlyArray1<'py, f32>>,
);

enum MlpGuard<'py> {
    Dense {
        gate_up: LinearGuard<'py>,
        down: LinearGuard<'py>,
    },
    Moe(MoeGuard<'py>),
}

struct MoeGuard<'py> {
    router: LinearGuard<'py>,
    experts: ExpertGuard<'py>,
    top_k: usize,
    normalize: bool,
    shared: Option<(LinearGuard<'py>, LinearGuard<'py>, LinearGuard<'py>)>,
}

enum ExpertGuard<'py> {
    Panels(PyReadonlyArray4<'py, f32>, PyReadonlyArray4<'py, f32>),
    /// the experts' two byte buffers and their layout
    Quant(HeldBytes<'py>),
}

fn read1<'py>(py: Python<'py>, a: &Py<PyArray1<f32>>) -> PyReadonlyArray1<'py, f32> {
    a.bind(py).readonly()
}

impl LinearArrays {
    fn borrow<'py>(&self, py: Python<'py>) -> LinearGuard<'py> {
        let weight = match &self.weight {
            WeightArrays::Panels(p, n) => WeightGuard::Panels(p.bind(py).readonly(), *n),
            WeightArrays::Quant(segments, k) => WeightGuard::Quant(
                segments
                    .iter()
                    .map(|s| match s.place {
                        Some(place) => SegmentGuard::Placed(s.code, place),
                        None => SegmentGuard::Own(s.code, s.array.bind(py).readonly()),
                    })
                    .collect(),
                *k,
            ),
        };
        let bias = self.bias.as_ref().map(|b| read1(py, b));
        LinearGuard { weight, bias }
    }

    fn place_in(&mut self, py: Python<'_>, buffers: &[(usize, usize)]) {
        if let WeightArrays::Quant(segments, _) = &mut self.weight {
            segments.iter_mut().for_each(|s| s.place_in(py, buffers));
        }
    }
}

impl MlpArrays {
    fn borrow<'py>(&self, py: Python<'py>) -> PyResult<MlpGuard<'py>> {
        Ok(match self {
            MlpArrays::Dense { gate_up, down } => MlpGuard::Dense {
                gate_up: gate_up.borrow(py),
                down: down.borrow(py),
            },
            MlpArrays::Moe(moe) => MlpGuard::Moe(MoeGuard {
                router: moe.router.borrow(py),
                experts: match &moe.experts {
                    ExpertArrays::Panels(g, d) => {
                        ExpertGuard::Panels(g.bind(py).readonly(), d.bind(py).readonly())
                    }
                    ExpertArrays::Quant(held) => ExpertGuard::Quant(held.get().borrow(py)?),
                },
                top_k: moe.top_k,
                normalize: moe.normalize,
                shared: moe
                    .shared
                    .as_ref()
                    .map(|(g, d, s)| (g.borrow(py), d.borrow(py), s.borrow(py))),
            }),
        })
    }
}

impl LayerArrays {
    fn borrow<'py>(&self, py: Python<'py>) -> PyResult<LayerGuard<'py>> {
        Ok(LayerGuard {
            input_norm: read1(py, &self.input_norm),
            qkv: self.qkv.borrow(py),
            qk_norm: self
                .qk_norm
                .as_ref()
                .map(|(q, k)| (read1(py, q), read1(py, k))),
            o: self.o.borrow(py),
            post_norm: read1(py, &self.post_norm),
            mlp: self.mlp.borrow(py)?,
            key_transform: self.key_transform.as_ref().map(|(q, k, c, f)| {
                let optional = |a: &Option<Vector>| a.as_ref().map(|a| read1(py, a));
                (read1(py, q), read1(py, k), optional(c), optional(f))
            }),
        })
    }
}

fn slice1<'a>(a: &'a PyReadonlyArray1<'_, f32>) -> PyResult<&'a [f32]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err("a norm weight or bias is not contiguous"))
}

impl LinearGuard<'_> {
    fn view<'a>(&'a self, bufs: &[&'a [u8]]) -> PyResult<Linear<'a>> {
        let weight = match &self.weight {
            WeightGuard::Panels(p, n) => Weight::Panels {
                panels: p.as_array(),
                n: *n,
            },
            WeightGuard::Quant(segments, k) => Weight::Quant(placed_matrix(segments, *k, bufs)?),
        };
        let bias = self.bias.as_ref().map(slice1).transpose()?;
        Ok(Linear { weight, bias })
    }
}

impl LayerGuard<'_> {
    fn view<'a>(&'a self, bufs: &[&'a [u8]]) -> PyResult<Layer<'a>> {
        let qk_norm = match &self.qk_norm {
            Some((q, k)) => Some((slice1(q)?, slice1(k)?)),
            None => None,
        };
        Ok(Layer {
            input_norm: slice1(&self.input_norm)?,
            qkv: self.qkv.view(bufs)?,
            qk_norm,
            o: self.o.view(bufs)?,
            post_norm: slice1(&self.post_norm)?,
            mlp: self.mlp.view(bufs)?,
            key_transform: match &self.key_transform {
                Some((q, k, c, f)) => Some(KeyTransform {
                    query_scale: slice1(q)?,
                    key_scale: slice1(k)?,
                    key_offset: c.as_ref().map(slice1).transpose()?,
                    key_feedback: f.as_ref().map(slice1).transpose()?,
                }),
                None => None,
            },
        })
    }
}

impl MlpGuard<'_> {
    fn view<'a>(&'a self, bufs: &[&'a [u8]]) -> PyResult<Mlp<'a>> {
        let moe = match self {
            MlpGuard::Dense { gate_up, down } => {
                return Ok(Mlp::Dense {
                    gate_up: gate_up.view(bufs)?,
                    down: down.view(bufs)?,
                })
            }
            MlpGuard::Moe(moe) => moe,
        };
        let experts = match &moe.experts {
            ExpertGuard::Panels(g, d) => Experts::Panels {
                gate_up: g.as_array(),
                down: d.as_array(),
            },
            ExpertGuard::Quant(held) => Experts::Quant(held.view()?),
        };
        let shared = match &moe.shared {
            Some((gate_up, down, gate)) => Some(SharedExpert {
                gate_up: gate_up.view(bufs)?,
                down: down.view(bufs)?,
                gate: gate.view(bufs)?,
            }),
            None => None,
        };
        Ok(Mlp::Moe(Box::new(MoeMlp {
            router: moe.router.view(bufs)?,
            experts,
            top_k: moe.top_k,
            normalize: moe.normalize,
            shared,
        })))
    }
}

#[pymethods]
impl CpuDecoder {
    /// `layers`: per layer `(input_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down)`
    /// (a sparse layer: `(..., post_norm, moe, None)`, `moe_arrays`),
    /// norms float32 `[E]` (q/k norms `[D]` or both None), projections as `linear_arrays` reads
    /// them. `key_transforms`: None, or per layer None or `(query_scale, key_scale, key_offset,
    /// key_feedback)` (`forward::KeyTransform`; a quantized cache's calibration).
    #[new]
    /// `ends`: None, or `(embedding, head)` for `logits`: the embedding `("table", float32 [V,
    /// E])` or `("quant", segments, k)`, the LM head a projection as `linear_arrays` reads it.
    #[pyo3(signature = (
        layers, final_norm, num_heads, num_kv_heads, head_dim, eps, scale, key_transforms = None,
        ends = None, buffers = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: Vec<Bound<'_, PyAny>>,
        final_norm: &Bound<'_, PyAny>,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        eps: f32,
        scale: f32,
        key_transforms: Option<Vec<Option<Bound<'_, PyAny>>>>,
        ends: Option<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
        buffers: Option<Vec<Bound<'_, PyAny>>>,
    ) -> PyResult<Self> {
        let mut layers = layers
            .iter()
            .enumerate()
            .map(|(i, l)| layer_arrays(l, i))
            .collect::<PyResult<Vec<_>>>()?;
        if let Some(transforms) = key_transforms {
            if transforms.len() != layers.len() {
                return Err(PyValueError::new_err(format!(
                    "key_transforms has {} entries for {} layers",
                    transforms.len(),
                    layers.len()
                )));
            }
            for (i, (layer, t)) in layers.iter_mut().zip(transforms).enumerate() {
                layer.key_transform = t.map(|t| key_transform_arrays(&t, i)).transpose()?;
            }
        }
        let mut ends = ends
            .map(|(e, h)| -> PyResult<_> {
                Ok((embedding_arrays(&e)?, linear_arrays(&h, "the LM head")?))
            })
            .transpose()?;
        let buffers = buffers
            .unwrap_or_default()
            .iter()
            .map(|b| {
                let b = b.cast::<PyArray1<u8>>().map_err(|_| {
                    PyTypeError::new_err("a weight buffer must be a 1-D uint8 array")
                })?;
                if !b.is_contiguous() {
                    return Err(PyValueError::new_err("a weight buffer must be contiguous"));
                }
                Ok(b.clone().unbind())
            })
            .collect::<PyResult<Vec<_>>>()?;
        if !buffers.is_empty() {
            let py = final_norm.py();
            let spans: Vec<(usize, usize)> = buffers
                .iter()
                .map(|b| (b.bind(py).data() as usize, b.bind(py).len()))
                .collect();
            for layer in &mut layers {
                layer.qkv.place_in(py, &spans);
                layer.o.place_in(py, &spans);
                if let MlpArrays::Dense { gate_up, down } = &mut layer.mlp {
                    gate_up.place_in(py, &spans);
                    down.place_in(py, &spans);
                }
            }
            if let Some((_, head)) = &mut ends {
                head.place_in(py, &spans);
            }
        }
        Ok(CpuDecoder {
            ends,
            buffers,
            layers,
            final_norm: array1(final_norm, "final_norm")?,
            shape: Shape {
                num_heads,
                num_kv_heads,
                head_dim,
                eps,
                scale,
            },
        })
    }

    /// Runs every layer and the final norm over `x [T, E]` in place (the step's embeddings in,
    /// hidden states out), storing K/V into `kv_cache` (`[2, L, blocks, block_size, KVH, D]`
    /// float32, or `kv_cache_dtype` "int8" (int8) / "fp8_e4m3" / "fp8_e5m2" (uint8 bits) with
    /// rows of `D + 1`, as `cpu_store_kvcache` writes them) and attending over it: `cos`/`sin`
    /// `[T, D / 2]`, `slot_mapping [T]`, and the sequences' `query_start_loc`, `seq_lens`,
    /// `block_tables` as paged attention takes them.
    #[pyo3(signature = (
        x, cos, sin, slot_mapping, query_start_loc, seq_lens, block_tables, kv_cache,
        num_threads, activations = "f32", kv_cache_dtype = "auto"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        slot_mapping: PyReadonlyArray1<'_, i64>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        block_tables: PyReadonlyArray2<'_, i32>,
        kv_cache: &Bound<'_, PyAny>,
        num_threads: usize,
        activations: &str,
        kv_cache_dtype: &str,
    ) -> PyResult<()> {
        let mut x = x
            .cast::<PyArray2<f32>>()
            .map_err(|_| PyTypeError::new_err("x must be a 2-D float32 array"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("x must be writeable ({e})")))?;
        let arrays = StepArrays {
            cos,
            sin,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            kv_cache,
        };
        let held = borrow_buffers(py, &self.buffers);
        let bufs = buffer_slices(&held)?;
        let opts = (num_threads, activations, kv_cache_dtype);
        self.run(py, x.as_array_mut(), arrays, None, &bufs, opts)
    }

    /// `forward` from token ids to the logits of the rows to sample: `ids [T]` embedded, every
    /// layer and the final norm run as `forward` runs them, then the LM head over rows
    /// `sample_rows [K]` of the hidden states into `logits [K, V]` (float32), one call for
    /// what `embed_tokens`, `forward`, `index_select` and `compute_logits` do. The decoder must
    /// hold its `ends`.
    #[pyo3(signature = (
        ids, cos, sin, slot_mapping, query_start_loc, seq_lens, block_tables, kv_cache,
        sample_rows, logits, num_threads, activations = "f32", kv_cache_dtype = "auto"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn logits(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, i64>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        slot_mapping: PyReadonlyArray1<'_, i64>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        block_tables: PyReadonlyArray2<'_, i32>,
        kv_cache: &Bound<'_, PyAny>,
        sample_rows: PyReadonlyArray1<'_, i64>,
        logits: &Bound<'_, PyAny>,
        num_threads: usize,
        activations: &str,
        kv_cache_dtype: &str,
    ) -> PyResult<()> {
        let (embedding, head) = self
            .ends
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this decoder holds no embedding and LM head"))?;
        let ids = ids
            .as_slice()
            .map_err(|_| PyValueError::new_err("ids must be contiguous"))?;
        let embedding = embedding.borrow(py);
        let mut x = Array2::<f32>::zeros((ids.len(), self.final_norm.bind(py).len()));
        forward::embed(&embedding.view()?, ids, x.view_mut())?;
        let mut logits = logits
            .cast::<PyArray2<f32>>()
            .map_err(|_| PyTypeError::new_err("logits must be a 2-D float32 array"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("logits must be writeable ({e})")))?;
        let rows = sample_rows
            .as_slice()
            .map_err(|_| PyValueError::new_err("sample_rows must be contiguous"))?;
        let held = borrow_buffers(py, &self.buffers);
        let bufs = buffer_slices(&held)?;
        let head = head.borrow(py);
        let head = head.view(&bufs)?;
        let arrays = StepArrays {
            cos,
            sin,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            kv_cache,
        };
        let tail = Head {
            linear: &head,
            rows,
            logits: logits.as_array_mut(),
        };
        let opts = (num_threads, activations, kv_cache_dtype);
        self.run(py, x.view_mut(), arrays, Some(tail), &bufs, opts)
    }

    /// Number of layers held.
    fn __len__(&self) -> usize {
        self.layers.len()
    }
}

/// A step's arrays as `forward` takes them.
struct StepArrays<'a, 'py> {
    cos: PyReadonlyArray2<'py, f32>,
    sin: PyReadonlyArray2<'py, f32>,
    slot_mapping: PyReadonlyArray1<'py, i64>,
    query_start_loc: PyReadonlyArray1<'py, i32>,
    seq_lens: PyReadonlyArray1<'py, i32>,
    block_tables: PyReadonlyArray2<'py, i32>,
    kv_cache: &'a Bound<'py, PyAny>,
}

/// The LM head after the layers (`logits`): its rows of the hidden states and their logits.
struct Head<'a, 'b> {
    linear: &'a Linear<'b>,
    rows: &'a [i64],
    logits: ArrayViewMut2<'a, f32>,
}

impl CpuDecoder {
    /// The layers over `x` (in place) and the step's cache, then `head` where given.
    /// `opts`: the threads, the activations and the cache's dtype, as `forward` takes them.
    fn run(
        &self,
        py: Python<'_>,
        mut x: ArrayViewMut2<'_, f32>,
        arrays: StepArrays<'_, '_>,
        head: Option<Head<'_, '_>>,
        bufs: &[&[u8]],
        (num_threads, activations, kv_cache_dtype): (usize, &str, &str),
    ) -> PyResult<()> {
        let StepArrays {
            cos,
            sin,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            kv_cache,
        } = arrays;
        let activations = super::cpu_quant::activations_named(activations)?;
        let kv_format = KvFormat::parse(kv_cache_dtype)?;
        let guards = self
            .layers
            .iter()
            .map(|l| l.borrow(py))
            .collect::<PyResult<Vec<LayerGuard<'_>>>>()?;
        let mut counts = self
            .layers
            .iter()
            .filter_map(|l| match &l.mlp {
                MlpArrays::Moe(moe) => Some(moe.counts.bind(py).try_readwrite()),
                MlpArrays::Dense { .. } => None,
            })
            .collect::<Result<Vec<PyReadwriteArray1<'_, i64>>, _>>()
            .map_err(|e| PyValueError::new_err(format!("expert counts must be writeable ({e})")))?;
        let mut counts = counts
            .iter_mut()
            .map(|c| c.as_slice_mut())
            .collect::<Result<Vec<&mut [i64]>, _>>()
            .map_err(|_| PyValueError::new_err("expert counts must be contiguous"))?;
        let layers = guards
            .iter()
            .map(|g| g.view(bufs))
            .collect::<PyResult<Vec<_>>>()?;
        let final_norm = read1(py, &self.final_norm);
        let final_norm = slice1(&final_norm)?;
        let contiguous = |what: &str| PyValueError::new_err(format!("{what} must be contiguous"));
        let query_start_loc = query_start_loc
            .as_slice()
            .map_err(|_| contiguous("query_start_loc"))?;
        let seq_lens = seq_lens.as_slice().map_err(|_| contiguous("seq_lens"))?;
        let slots = slot_mapping
            .as_slice()
            .map_err(|_| contiguous("slot_mapping"))?;
        let step = Step {
            cos: cos.as_array(),
            sin: sin.as_array(),
            slot_mapping: slots,
            batch: PagedBatch {
                query_start_loc,
                seq_lens,
                block_tables: block_tables.as_array(),
            },
        };
        let opts = Options {
            num_threads,
            activations,
        };
        let run = Run {
            x: x.view_mut(),
            layers: &layers,
            final_norm,
            shape: self.shape,
            step: &step,
            expert_counts: &mut counts,
            opts,
        };
        match kv_format {
            KvFormat::Auto => run.over::<FloatKv<f32>>(py, kv_cache, head),
            KvFormat::Int8 => run.over::<Int8Kv>(py, kv_cache, head),
            KvFormat::Fp8E4M3 => run.over::<Fp8E4M3Kv>(py, kv_cache, head),
            KvFormat::Fp8E5M2 => run.over::<Fp8E5M2Kv>(py, kv_cache, head),
        }
    }
}

/// A step's arguments but the cache, whose element type the call picks (`kv_cache_dtype`).
struct Run<'a, 'b> {
    x: ArrayViewMut2<'a, f32>,
    layers: &'a [Layer<'b>],
    final_norm: &'a [f32],
    shape: Shape,
    step: &'a Step<'a>,
    expert_counts: &'a mut [&'b mut [i64]],
    opts: Options,
}

impl Run<'_, '_> {
    /// The decoder over `kv_cache`, a 6-D array of `C`'s numpy dtype, then `head` where given.
    fn over<C: KvDtype>(
        self,
        py: Python<'_>,
        kv_cache: &Bound<'_, PyAny>,
        head: Option<Head<'_, '_>>,
    ) -> PyResult<()> {
        let mut kv_cache = kv_cache
            .cast::<PyArray<C::Numpy, Ix6>>()
            .map_err(|_| PyTypeError::new_err(format!("kv_cache must be a 6-D {} array", C::NAME)))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("kv_cache must be writeable ({e})")))?;
        let kv_cache = cast_view_mut::<_, C::Kernel, _>(kv_cache.as_array_mut());
        let Run {
            mut x,
            layers,
            final_norm,
            shape,
            step,
            expert_counts,
            opts,
        } = self;
        py.detach(|| {
            forward::decoder_forward(
                x.view_mut(),
                layers,
                final_norm,
                shape,
                step,
                kv_cache,
                expert_counts,
                opts,
            )?;
            match head {
                Some(h) => forward::head_logits(x.view(), h.rows, h.linear, h.logits, opts),
                None => Ok(()),
            }
        })?;
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuDecoder>()
}
