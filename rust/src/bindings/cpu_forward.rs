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
use super::cpu_ops::{Dtype, FloatKv, Fp8E4M3Kv, Fp8E5M2Kv, Int8Kv, KvDtype, KvFormat};
use super::cpu_quant::{matrix, Segments};
use crate::cpu::attention::PagedBatch;
use crate::cpu::forward::{
    self, Act, Embedding, Experts, KeyTransform, Layer, Linear, Mlp, MoeMlp, Options, Shape,
    SharedExpert, Step, Weight,
};
use crate::cpu::quant::{QType, QuantMatrix, Segment};
use crate::cpu::views::{cast_view, cast_view_mut};
use crate::cpu::{Elem, KvElem};

/// A numpy dtype the decoder's activations and float weights come in (float32, or bfloat16 as
/// its uint16 bits) whose kernel element the forward runs on.
trait ActDtype: Dtype<Kernel: Act + KvElem> {}

impl<N: Dtype<Kernel: Act + KvElem>> ActDtype for N {}

/// A projection's arrays: panels of `n` outputs, or ggml segments of rows of `k` elements.
enum WeightArrays<N> {
    Panels(Py<PyArray3<N>>, usize),
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

struct LinearArrays<N> {
    weight: WeightArrays<N>,
    bias: Option<Py<PyArray1<N>>>,
}

/// A key transform's vector, held (float32).
type Vector = Py<PyArray1<f32>>;

/// A norm weight or a bias, held, in the activations' dtype.
type Weights1<N> = Py<PyArray1<N>>;

struct LayerArrays<N> {
    input_norm: Weights1<N>,
    qkv: LinearArrays<N>,
    qk_norm: Option<(Weights1<N>, Weights1<N>)>,
    o: LinearArrays<N>,
    post_norm: Weights1<N>,
    mlp: MlpArrays<N>,
    /// query scale, key scale, key offset, key feedback (`models/cpu_forward.py`'s
    /// `_key_transform`)
    key_transform: Option<KeyArrays>,
}

enum MlpArrays<N> {
    Dense {
        gate_up: LinearArrays<N>,
        down: LinearArrays<N>,
    },
    Moe(MoeArrays<N>),
}

/// A sparse layer's MLP (`models/cpu_forward.py`'s `_moe`).
struct MoeArrays<N> {
    router: LinearArrays<N>,
    experts: ExpertArrays<N>,
    top_k: usize,
    normalize: bool,
    round_weights: bool,
    /// gate_up, down, gate
    shared: Option<(LinearArrays<N>, LinearArrays<N>, LinearArrays<N>)>,
    /// the block's `expert_tokens` `[E]`, added to in place
    counts: Py<PyArray1<i64>>,
}

enum ExpertArrays<N> {
    /// stacked gate/up and down panels
    Panels(Py<PyArray4<N>>, Py<PyArray4<N>>),
    Quant(Py<CpuMoeQuantExperts>),
}

/// The token embedding `logits` reads its rows from.
enum EmbeddingArrays<N> {
    /// `[V, E]` in the activations' dtype
    Table(Py<PyArray2<N>>),
    /// ggml segments of rows of `k` elements
    Quant(Vec<(u32, Py<PyArray2<u8>>)>, usize),
}

/// A decoder's weights for `forward` (see `models/cpu_forward.py`, which builds it).
#[pyclass(frozen, module = "pagedllm._core")]
pub struct CpuDecoder {
    /// the layers, the final norm and the ends, in float32 or bfloat16 (`final_norm`'s dtype)
    weights: Weights,
    shape: Shape,
    /// uint8 buffers holding quantized segments (the huge-page weight buffer): each borrowed
    /// once a call, the segments in them sliced from it (`HeldSegment`)
    buffers: Vec<Py<PyArray1<u8>>>,
}

/// A decoder's float arrays, in the activations' dtype `N`.
struct Held<N> {
    layers: Vec<LayerArrays<N>>,
    final_norm: Py<PyArray1<N>>,
    /// the embedding and the LM head, both or neither: `logits` runs only with them
    ends: Option<(EmbeddingArrays<N>, LinearArrays<N>)>,
}

enum Weights {
    F32(Held<f32>),
    /// bfloat16 as uint16 bits
    Bf16(Held<u16>),
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

/// `("table", [V, E] in N)` or `("quant", [(type, uint8 [rows, bytes])], k)`.
fn embedding_arrays<N: Dtype>(spec: &Bound<'_, PyAny>) -> PyResult<EmbeddingArrays<N>> {
    let parts = spec
        .cast::<PyTuple>()
        .map_err(|_| PyTypeError::new_err("embedding must be a tuple"))?;
    let kind: String = parts.get_item(0)?.extract()?;
    match (kind.as_str(), parts.len()) {
        ("table", 2) => {
            let table = parts.get_item(1)?;
            let table = table.cast::<PyArray2<N>>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "the embedding table must be a 2-D {} array",
                    N::NAME
                ))
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
enum EmbeddingGuard<'py, N: Dtype> {
    Table(PyReadonlyArray2<'py, N>),
    Quant(Segments<'py>, usize),
}

impl<N: Dtype> EmbeddingArrays<N> {
    fn borrow<'py>(&self, py: Python<'py>) -> EmbeddingGuard<'py, N> {
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

impl<N: Dtype> EmbeddingGuard<'_, N> {
    fn view(&self) -> PyResult<Embedding<'_, N::Kernel>> {
        Ok(match self {
            EmbeddingGuard::Table(t) => Embedding::Table(cast_view(t.as_array())),
            EmbeddingGuard::Quant(segments, k) => Embedding::Quant(matrix(segments, *k)?),
        })
    }
}

fn array1<N: Dtype>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Py<PyArray1<N>>> {
    let array = obj
        .cast::<PyArray1<N>>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a 1-D {} array", N::NAME)))?;
    if !array.is_contiguous() {
        return Err(PyValueError::new_err(format!("{what} must be contiguous")));
    }
    Ok(array.clone().unbind())
}

/// `("panels", [P, K, 16], n, bias)` or `("quant", [(type, uint8 [rows, bytes])], k, bias)`;
/// bias None or `[N]`; panels and bias in the activations' dtype `N`.
fn linear_arrays<N: Dtype>(spec: &Bound<'_, PyAny>, what: &str) -> PyResult<LinearArrays<N>> {
    let (kind, weight, size, bias): (String, Bound<'_, PyAny>, usize, Option<Bound<'_, PyAny>>) =
        spec.extract().map_err(|_| {
            PyTypeError::new_err(format!("{what} must be (kind, weight, size, bias)"))
        })?;
    let weight = match kind.as_str() {
        "panels" => {
            let panels = weight.cast::<PyArray3<N>>().map_err(|_| {
                PyTypeError::new_err(format!("{what}'s panels must be a 3-D {} array", N::NAME))
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

fn layer_arrays<N: Dtype>(spec: &Bound<'_, PyAny>, i: usize) -> PyResult<LayerArrays<N>> {
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
fn moe_arrays<N: Dtype>(spec: &Bound<'_, PyAny>, what: &str) -> PyResult<MoeArrays<N>> {
    type Spec<'py> = (
        String,
        Bound<'py, PyAny>,
        Bound<'py, PyTuple>,
        usize,
        (bool, bool),
        Option<Bound<'py, PyTuple>>,
        Bound<'py, PyAny>,
    );
    let (kind, router, experts, top_k, (normalize, round_weights), shared, counts): Spec<'_> =
        spec.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be ('moe', router, experts, top_k, (normalize, round_weights), \
                 shared, counts)"
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
            let panels = |j: usize| -> PyResult<Py<PyArray4<N>>> {
                let item = experts.get_item(j)?;
                let array = item.cast::<PyArray4<N>>().map_err(|_| {
                    PyTypeError::new_err(format!("{what}'s expert panels must be 4-D {}", N::NAME))
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
        round_weights,
        shared,
        counts,
    })
}

/// The arrays of one projection borrowed for a call.
enum WeightGuard<'py, N: Dtype> {
    Panels(PyReadonlyArray3<'py, N>, usize),
    Quant(Vec<SegmentGuard<'py>>, usize),
}

struct LinearGuard<'py, N: Dtype> {
    weight: WeightGuard<'py, N>,
    bias: Option<PyReadonlyArray1<'py, N>>,
}

struct LayerGuard<'py, N: Dtype> {
    input_norm: PyReadonlyArray1<'py, N>,
    qkv: LinearGuard<'py, N>,
    qk_norm: Option<(PyReadonlyArray1<'py, N>, PyReadonlyArray1<'py, N>)>,
    o: LinearGuard<'py, N>,
    post_norm: PyReadonlyArray1<'py, N>,
    mlp: MlpGuard<'py, N>,
    key_transform: Option<KeyGuard<'py>>,
}

type KeyGuard<'py> = (
    PyReadonlyArray1<'py, f32>,
    PyReadonlyArray1<'py, f32>,
    Option<PyReadonlyArray1<'py, f32>>,
    Option<PyReadonlyArray1<'py, f32>>,
);

enum MlpGuard<'py, N: Dtype> {
    Dense {
        gate_up: LinearGuard<'py, N>,
        down: LinearGuard<'py, N>,
    },
    Moe(MoeGuard<'py, N>),
}

struct MoeGuard<'py, N: Dtype> {
    router: LinearGuard<'py, N>,
    experts: ExpertGuard<'py, N>,
    top_k: usize,
    normalize: bool,
    round_weights: bool,
    shared: Option<(
        LinearGuard<'py, N>,
        LinearGuard<'py, N>,
        LinearGuard<'py, N>,
    )>,
}

enum ExpertGuard<'py, N: Dtype> {
    Panels(PyReadonlyArray4<'py, N>, PyReadonlyArray4<'py, N>),
    /// the experts' two byte buffers and their layout
    Quant(HeldBytes<'py>),
}

fn read1<'py, N: Dtype>(py: Python<'py>, a: &Py<PyArray1<N>>) -> PyReadonlyArray1<'py, N> {
    a.bind(py).readonly()
}

impl<N: Dtype> LinearArrays<N> {
    fn borrow<'py>(&self, py: Python<'py>) -> LinearGuard<'py, N> {
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

impl<N: Dtype> MlpArrays<N> {
    fn borrow<'py>(&self, py: Python<'py>) -> PyResult<MlpGuard<'py, N>> {
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
                round_weights: moe.round_weights,
                shared: moe
                    .shared
                    .as_ref()
                    .map(|(g, d, s)| (g.borrow(py), d.borrow(py), s.borrow(py))),
            }),
        })
    }
}

impl<N: Dtype> LayerArrays<N> {
    fn borrow<'py>(&self, py: Python<'py>) -> PyResult<LayerGuard<'py, N>> {
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
        .map_err(|_| PyValueError::new_err("a key transform vector is not contiguous"))
}

/// A norm weight or a bias as the kernels' elements.
fn kernel1<'a, N: Dtype>(a: &'a PyReadonlyArray1<'_, N>) -> PyResult<&'a [N::Kernel]> {
    cast_view(a.as_array())
        .to_slice()
        .ok_or_else(|| PyValueError::new_err("a norm weight or bias is not contiguous"))
}

impl<N: Dtype> LinearGuard<'_, N> {
    fn view<'a>(&'a self, bufs: &[&'a [u8]]) -> PyResult<Linear<'a, N::Kernel>> {
        let weight = match &self.weight {
            WeightGuard::Panels(p, n) => Weight::Panels {
                panels: cast_view(p.as_array()),
                n: *n,
            },
            WeightGuard::Quant(segments, k) => Weight::Quant(placed_matrix(segments, *k, bufs)?),
        };
        let bias = self.bias.as_ref().map(kernel1).transpose()?;
        Ok(Linear { weight, bias })
    }
}

impl<N: Dtype> LayerGuard<'_, N> {
    fn view<'a>(&'a self, bufs: &[&'a [u8]]) -> PyResult<Layer<'a, N::Kernel>> {
        let qk_norm = match &self.qk_norm {
            Some((q, k)) => Some((kernel1(q)?, kernel1(k)?)),
            None => None,
        };
        Ok(Layer {
            input_norm: kernel1(&self.input_norm)?,
            qkv: self.qkv.view(bufs)?,
            qk_norm,
            o: self.o.view(bufs)?,
            post_norm: kernel1(&self.post_norm)?,
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

impl<N: Dtype> MlpGuard<'_, N> {
    fn view<'a>(&'a self, bufs: &[&'a [u8]]) -> PyResult<Mlp<'a, N::Kernel>> {
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
                gate_up: cast_view(g.as_array()),
                down: cast_view(d.as_array()),
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
            round_weights: moe.round_weights,
            shared,
        })))
    }
}

#[pymethods]
impl CpuDecoder {
    /// `layers`: per layer `(input_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down)`
    /// (a sparse layer: `(..., post_norm, moe, None)`, `moe_arrays`),
    /// norms `[E]` (q/k norms `[D]` or both None), projections as `linear_arrays` reads
    /// them, every float array float32 or every one bfloat16 (uint16 bits): `final_norm`'s dtype
    /// is the activations'. `key_transforms`: None, or per layer None or `(query_scale,
    /// key_scale, key_offset, key_feedback)` (`forward::KeyTransform`; a quantized cache's
    /// calibration, float32).
    #[new]
    /// `ends`: None, or `(embedding, head)` for `logits`: the embedding `("table", [V, E])` or
    /// `("quant", segments, k)`, the LM head a projection as `linear_arrays` reads it.
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
        let py = final_norm.py();
        let spans: Vec<(usize, usize)> = buffers
            .iter()
            .map(|b| (b.bind(py).data() as usize, b.bind(py).len()))
            .collect();
        let parts = (&layers[..], final_norm, key_transforms, ends, &spans[..]);
        let weights = if final_norm.cast::<PyArray1<u16>>().is_ok() {
            Weights::Bf16(held(parts)?)
        } else {
            Weights::F32(held(parts)?)
        };
        Ok(CpuDecoder {
            weights,
            buffers,
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
    /// in the activations' dtype, or `kv_cache_dtype` "int8" (int8) / "fp8_e4m3" / "fp8_e5m2"
    /// (uint8 bits) with rows of `D + 1`, as `cpu_store_kvcache` writes them) and attending over
    /// it: `cos`/`sin` `[T, D / 2]`, `slot_mapping [T]`, and the sequences' `query_start_loc`,
    /// `seq_lens`, `block_tables` as paged attention takes them. `x`, `cos` and `sin` are in the
    /// activations' dtype (float32, or bfloat16 as uint16 bits).
    #[pyo3(signature = (
        x, cos, sin, slot_mapping, query_start_loc, seq_lens, block_tables, kv_cache,
        num_threads, activations = "f32", kv_cache_dtype = "auto"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        cos: &Bound<'_, PyAny>,
        sin: &Bound<'_, PyAny>,
        slot_mapping: PyReadonlyArray1<'_, i64>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        block_tables: PyReadonlyArray2<'_, i32>,
        kv_cache: &Bound<'_, PyAny>,
        num_threads: usize,
        activations: &str,
        kv_cache_dtype: &str,
    ) -> PyResult<()> {
        let arrays = StepArrays {
            cos,
            sin,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            kv_cache,
        };
        let opts = (num_threads, activations, kv_cache_dtype);
        match &self.weights {
            Weights::F32(held) => self.forward_in(py, held, x, arrays, opts),
            Weights::Bf16(held) => self.forward_in(py, held, x, arrays, opts),
        }
    }

    /// `forward` from token ids to the logits of the rows to sample: `ids [T]` embedded, every
    /// layer and the final norm run as `forward` runs them, then the LM head over rows
    /// `sample_rows [K]` of the hidden states into `logits [K, V]` (float32; a bfloat16 head's
    /// logits widened exactly, as `.float()` does), one call for what `embed_tokens`,
    /// `forward`, `index_select` and `compute_logits` do. The decoder must hold its `ends`.
    #[pyo3(signature = (
        ids, cos, sin, slot_mapping, query_start_loc, seq_lens, block_tables, kv_cache,
        sample_rows, logits, num_threads, activations = "f32", kv_cache_dtype = "auto"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn logits(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, i64>,
        cos: &Bound<'_, PyAny>,
        sin: &Bound<'_, PyAny>,
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
        let arrays = StepArrays {
            cos,
            sin,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            kv_cache,
        };
        let mut logits = logits
            .cast::<PyArray2<f32>>()
            .map_err(|_| PyTypeError::new_err("logits must be a 2-D float32 array"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("logits must be writeable ({e})")))?;
        let rows = sample_rows
            .as_slice()
            .map_err(|_| PyValueError::new_err("sample_rows must be contiguous"))?;
        let ids = ids
            .as_slice()
            .map_err(|_| PyValueError::new_err("ids must be contiguous"))?;
        let tail = (ids, rows, logits.as_array_mut());
        let opts = (num_threads, activations, kv_cache_dtype);
        match &self.weights {
            Weights::F32(held) => self.logits_in(py, held, tail, arrays, opts),
            Weights::Bf16(held) => self.logits_in(py, held, tail, arrays, opts),
        }
    }

    /// Number of layers held.
    fn __len__(&self) -> usize {
        match &self.weights {
            Weights::F32(held) => held.layers.len(),
            Weights::Bf16(held) => held.layers.len(),
        }
    }
}

/// `CpuDecoder::new`'s arrays in dtype `N`: (layers, final_norm, key_transforms, ends, the
/// weight buffers' spans).
type Parts<'a, 'py> = (
    &'a [Bound<'py, PyAny>],
    &'a Bound<'py, PyAny>,
    Option<Vec<Option<Bound<'py, PyAny>>>>,
    Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    &'a [(usize, usize)],
);

fn held<N: Dtype>(
    (layers, final_norm, key_transforms, ends, spans): Parts<'_, '_>,
) -> PyResult<Held<N>> {
    let mut layers = layers
        .iter()
        .enumerate()
        .map(|(i, l)| layer_arrays(l, i))
        .collect::<PyResult<Vec<LayerArrays<N>>>>()?;
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
    if !spans.is_empty() {
        let py = final_norm.py();
        for layer in &mut layers {
            layer.qkv.place_in(py, spans);
            layer.o.place_in(py, spans);
            if let MlpArrays::Dense { gate_up, down } = &mut layer.mlp {
                gate_up.place_in(py, spans);
                down.place_in(py, spans);
            }
        }
        if let Some((_, head)) = &mut ends {
            head.place_in(py, spans);
        }
    }
    Ok(Held {
        layers,
        ends,
        final_norm: array1(final_norm, "final_norm")?,
    })
}

/// A step's arrays as `forward` takes them (`cos`, `sin` in the activations' dtype).
struct StepArrays<'a, 'py> {
    cos: &'a Bound<'py, PyAny>,
    sin: &'a Bound<'py, PyAny>,
    slot_mapping: PyReadonlyArray1<'py, i64>,
    query_start_loc: PyReadonlyArray1<'py, i32>,
    seq_lens: PyReadonlyArray1<'py, i32>,
    block_tables: PyReadonlyArray2<'py, i32>,
    kv_cache: &'a Bound<'py, PyAny>,
}

/// The LM head after the layers (`logits`): its rows of the hidden states and their logits.
struct Head<'a, 'b, T> {
    linear: &'a Linear<'b, T>,
    rows: &'a [i64],
    logits: ArrayViewMut2<'a, f32>,
}

/// `(num_threads, activations, kv_cache_dtype)` as `forward` takes them.
type RunOpts<'a> = (usize, &'a str, &'a str);

fn table<'py, N: Dtype>(a: &Bound<'py, PyAny>, what: &str) -> PyResult<PyReadonlyArray2<'py, N>> {
    Ok(a.cast::<PyArray2<N>>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a 2-D {} array", N::NAME)))?
        .readonly())
}

impl CpuDecoder {
    fn forward_in<N: ActDtype>(
        &self,
        py: Python<'_>,
        held: &Held<N>,
        x: &Bound<'_, PyAny>,
        arrays: StepArrays<'_, '_>,
        opts: RunOpts<'_>,
    ) -> PyResult<()> {
        let mut x = x
            .cast::<PyArray2<N>>()
            .map_err(|_| PyTypeError::new_err(format!("x must be a 2-D {} array", N::NAME)))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("x must be writeable ({e})")))?;
        let borrowed = borrow_buffers(py, &self.buffers);
        let bufs = buffer_slices(&borrowed)?;
        let x = cast_view_mut(x.as_array_mut());
        self.run(py, held, x, arrays, None, &bufs, opts)
    }

    fn logits_in<N: ActDtype>(
        &self,
        py: Python<'_>,
        held: &Held<N>,
        (ids, rows, mut logits): (&[i64], &[i64], ArrayViewMut2<'_, f32>),
        arrays: StepArrays<'_, '_>,
        opts: RunOpts<'_>,
    ) -> PyResult<()> {
        let (embedding, head) = held
            .ends
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this decoder holds no embedding and LM head"))?;
        let embedding = embedding.borrow(py);
        let hidden = held.final_norm.bind(py).len();
        let mut x = Array2::<N::Kernel>::from_elem((ids.len(), hidden), <N::Kernel as Elem>::ZERO);
        forward::embed(&embedding.view()?, ids, x.view_mut())?;
        let borrowed = borrow_buffers(py, &self.buffers);
        let bufs = buffer_slices(&borrowed)?;
        let head = head.borrow(py);
        let head = head.view(&bufs)?;
        let tail = Head {
            linear: &head,
            rows,
            logits: logits.view_mut(),
        };
        self.run(py, held, x.view_mut(), arrays, Some(tail), &bufs, opts)
    }

    /// The layers over `x` (in place) and the step's cache, then `head` where given.
    /// `opts`: the threads, the activations and the cache's dtype, as `forward` takes them.
    #[allow(clippy::too_many_arguments)]
    fn run<N: ActDtype>(
        &self,
        py: Python<'_>,
        held: &Held<N>,
        mut x: ArrayViewMut2<'_, N::Kernel>,
        arrays: StepArrays<'_, '_>,
        head: Option<Head<'_, '_, N::Kernel>>,
        bufs: &[&[u8]],
        (num_threads, activations, kv_cache_dtype): RunOpts<'_>,
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
        let (cos, sin) = (table::<N>(cos, "cos")?, table::<N>(sin, "sin")?);
        let activations = super::cpu_quant::activations_named(activations)?;
        let kv_format = KvFormat::parse(kv_cache_dtype)?;
        let guards = held
            .layers
            .iter()
            .map(|l| l.borrow(py))
            .collect::<PyResult<Vec<LayerGuard<'_, N>>>>()?;
        let mut counts = held
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
        let final_norm = read1(py, &held.final_norm);
        let final_norm = kernel1(&final_norm)?;
        let contiguous = |what: &str| PyValueError::new_err(format!("{what} must be contiguous"));
        let query_start_loc = query_start_loc
            .as_slice()
            .map_err(|_| contiguous("query_start_loc"))?;
        let seq_lens = seq_lens.as_slice().map_err(|_| contiguous("seq_lens"))?;
        let slots = slot_mapping
            .as_slice()
            .map_err(|_| contiguous("slot_mapping"))?;
        let step = Step {
            cos: cast_view(cos.as_array()),
            sin: cast_view(sin.as_array()),
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
        match kv_format.of_cache(kv_cache) {
            KvFormat::Auto => run.over::<FloatKv<N>>(py, kv_cache, head),
            KvFormat::Bf16 => run.over::<FloatKv<u16>>(py, kv_cache, head),
            KvFormat::Int8 => run.over::<Int8Kv>(py, kv_cache, head),
            KvFormat::Fp8E4M3 => run.over::<Fp8E4M3Kv>(py, kv_cache, head),
            KvFormat::Fp8E5M2 => run.over::<Fp8E5M2Kv>(py, kv_cache, head),
        }
    }
}

/// A step's arguments but the cache, whose element type the call picks (`kv_cache_dtype`).
struct Run<'a, 'b, T> {
    x: ArrayViewMut2<'a, T>,
    layers: &'a [Layer<'b, T>],
    final_norm: &'a [T],
    shape: Shape,
    step: &'a Step<'a, T>,
    expert_counts: &'a mut [&'b mut [i64]],
    opts: Options,
}

impl<T: Act> Run<'_, '_, T> {
    /// The decoder over `kv_cache`, a 6-D array of `C`'s numpy dtype, then `head` where given.
    fn over<C: KvDtype>(
        self,
        py: Python<'_>,
        kv_cache: &Bound<'_, PyAny>,
        head: Option<Head<'_, '_, T>>,
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
