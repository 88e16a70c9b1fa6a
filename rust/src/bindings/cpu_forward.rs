//! `CpuDecoder`: a model's layer weights held once (numpy arrays: `linear`'s panels or a GGUF
//! weight's segments), and `forward`, the whole decoder over one step in one call with the GIL
//! released (`crate::cpu::forward`).
use numpy::ndarray::{ArrayViewMut2, Ix6};
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
    self, Experts, KeyTransform, Layer, Linear, Mlp, MoeMlp, Options, Shape, SharedExpert, Step,
    Weight,
};
use crate::cpu::views::cast_view_mut;

/// A projection's arrays: panels of `n` outputs, or ggml segments of rows of `k` elements.
enum WeightArrays {
    Panels(Py<PyArray3<f32>>, usize),
    Quant(Vec<(u32, Py<PyArray2<u8>>)>, usize),
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

/// A decoder's weights for `forward` (see `models/cpu_forward.py`, which builds it).
#[pyclass(frozen, module = "pagedllm._core")]
pub struct CpuDecoder {
    layers: Vec<LayerArrays>,
    final_norm: Py<PyArray1<f32>>,
    shape: Shape,
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
            let segments = segments.into_iter().map(|(t, a)| (t, a.unbind())).collect();
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
    Quant(Segments<'py>, usize),
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
                    .map(|(t, a)| (*t, a.bind(py).readonly()))
                    .collect(),
                *k,
            ),
        };
        let bias = self.bias.as_ref().map(|b| read1(py, b));
        LinearGuard { weight, bias }
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
    fn view(&self) -> PyResult<Linear<'_>> {
        let weight = match &self.weight {
            WeightGuard::Panels(p, n) => Weight::Panels {
                panels: p.as_array(),
                n: *n,
            },
            WeightGuard::Quant(segments, k) => Weight::Quant(matrix(segments, *k)?),
        };
        let bias = self.bias.as_ref().map(slice1).transpose()?;
        Ok(Linear { weight, bias })
    }
}

impl LayerGuard<'_> {
    fn view(&self) -> PyResult<Layer<'_>> {
        let qk_norm = match &self.qk_norm {
            Some((q, k)) => Some((slice1(q)?, slice1(k)?)),
            None => None,
        };
        Ok(Layer {
            input_norm: slice1(&self.input_norm)?,
            qkv: self.qkv.view()?,
            qk_norm,
            o: self.o.view()?,
            post_norm: slice1(&self.post_norm)?,
            mlp: self.mlp.view()?,
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
    fn view(&self) -> PyResult<Mlp<'_>> {
        let moe = match self {
            MlpGuard::Dense { gate_up, down } => {
                return Ok(Mlp::Dense {
                    gate_up: gate_up.view()?,
                    down: down.view()?,
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
                gate_up: gate_up.view()?,
                down: down.view()?,
                gate: gate.view()?,
            }),
            None => None,
        };
        Ok(Mlp::Moe(Box::new(MoeMlp {
            router: moe.router.view()?,
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
    #[pyo3(signature = (
        layers, final_norm, num_heads, num_kv_heads, head_dim, eps, scale, key_transforms = None
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
        Ok(CpuDecoder {
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
            .map(LayerGuard::view)
            .collect::<PyResult<Vec<_>>>()?;
        let final_norm = read1(py, &self.final_norm);
        let final_norm = slice1(&final_norm)?;
        let mut x = x
            .cast::<PyArray2<f32>>()
            .map_err(|_| PyTypeError::new_err("x must be a 2-D float32 array"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("x must be writeable ({e})")))?;
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
            x: x.as_array_mut(),
            layers: &layers,
            final_norm,
            shape: self.shape,
            step: &step,
            expert_counts: &mut counts,
            opts,
        };
        match kv_format {
            KvFormat::Auto => run.over::<FloatKv<f32>>(py, kv_cache),
            KvFormat::Int8 => run.over::<Int8Kv>(py, kv_cache),
            KvFormat::Fp8E4M3 => run.over::<Fp8E4M3Kv>(py, kv_cache),
            KvFormat::Fp8E5M2 => run.over::<Fp8E5M2Kv>(py, kv_cache),
        }
    }

    /// Number of layers held.
    fn __len__(&self) -> usize {
        self.layers.len()
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
    /// The decoder over `kv_cache`, a 6-D array of `C`'s numpy dtype.
    fn over<C: KvDtype>(self, py: Python<'_>, kv_cache: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut kv_cache = kv_cache
            .cast::<PyArray<C::Numpy, Ix6>>()
            .map_err(|_| PyTypeError::new_err(format!("kv_cache must be a 6-D {} array", C::NAME)))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("kv_cache must be writeable ({e})")))?;
        let kv_cache = cast_view_mut::<_, C::Kernel, _>(kv_cache.as_array_mut());
        let Run {
            x,
            layers,
            final_norm,
            shape,
            step,
            expert_counts,
            opts,
        } = self;
        py.detach(|| {
            forward::decoder_forward(
                x,
                layers,
                final_norm,
                shape,
                step,
                kv_cache,
                expert_counts,
                opts,
            )
        })?;
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuDecoder>()
}
