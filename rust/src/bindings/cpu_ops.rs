//! The CPU kernels (`crate::cpu`) for the model runner: torch CPU tensors arrive as numpy views
//! of the same memory (`Tensor.numpy()`, no copy), the kernels run with the GIL released.
//!
//! The float arrays of a call are float32, or bfloat16 passed as its uint16 bits (numpy has no
//! bfloat16; torch's `t.view(torch.uint16).numpy()` shares the memory). The first float argument
//! picks the kernel; the others must have its dtype.
use ndarray::{ArrayView, ArrayViewMut, Dimension};
use numpy::{
    Element, PyArray, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray,
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn, PyReadwriteArray, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::cpu::views::{cast_view, cast_view_mut, SameLayout};
use crate::cpu::{self, Bf16, PagedBatch, Scores};

fn contiguous<'a, T: numpy::Element>(name: &str, a: &'a PyReadonlyArray1<T>) -> PyResult<&'a [T]> {
    contiguous_view(name, a.as_array())
}

/// A kernel's 1-D view as a slice, or a ValueError naming the array.
fn contiguous_view<'a, T>(name: &str, a: ndarray::ArrayView1<'a, T>) -> PyResult<&'a [T]> {
    a.to_slice()
        .ok_or_else(|| PyValueError::new_err(format!("{name} must be a contiguous 1-D array")))
}

/// A numpy dtype the kernels take and the kernel element behind it (same size and layout).
pub(super) trait Dtype: Element + 'static {
    type Kernel: cpu::Elem + SameLayout<Self>;
    const NAME: &'static str;
}

impl Dtype for f32 {
    type Kernel = f32;
    const NAME: &'static str = "float32";
}

impl Dtype for u16 {
    type Kernel = Bf16;
    const NAME: &'static str = "uint16 (bfloat16 bits)";
}

/// Which kernel a call takes, from its first float array's dtype.
pub(super) enum Kind {
    F32,
    Bf16,
}

impl Kind {
    pub(super) fn of(name: &str, a: &Bound<'_, PyAny>) -> PyResult<Self> {
        let array = a
            .cast::<PyUntypedArray>()
            .map_err(|_| PyTypeError::new_err(format!("{name} must be a numpy array")))?;
        let dtype = array.dtype();
        let py = a.py();
        if dtype.is_equiv_to(&numpy::dtype::<f32>(py)) {
            Ok(Kind::F32)
        } else if dtype.is_equiv_to(&numpy::dtype::<u16>(py)) {
            Ok(Kind::Bf16)
        } else {
            Err(PyTypeError::new_err(format!(
                "{name} has dtype {dtype}; the CPU kernels take float32, or bfloat16 as its \
                 uint16 bits"
            )))
        }
    }
}

pub(super) fn readonly<'py, N: Dtype, D: Dimension>(
    name: &str,
    a: &Bound<'py, PyAny>,
) -> PyResult<PyReadonlyArray<'py, N, D>> {
    a.extract().map_err(|e| wrong_array::<N, D>(name, a, e))
}

/// A writeable array; a ValueError (not numpy's panic) when it shares memory with an array the
/// call already holds.
pub(super) fn readwrite<'py, N: Dtype, D: Dimension>(
    name: &str,
    a: &Bound<'py, PyAny>,
) -> PyResult<PyReadwriteArray<'py, N, D>> {
    let array = a
        .cast::<PyArray<N, D>>()
        .map_err(|e| wrong_array::<N, D>(name, a, e.into()))?;
    array.try_readwrite().map_err(|e| {
        PyValueError::new_err(format!(
            "{name} must be writeable and share no memory with the call's other arrays ({e})"
        ))
    })
}

/// The error for an array that did not extract: its dtype or rank if those are wrong, else
/// numpy's own (e.g. not writeable).
fn wrong_array<N: Dtype, D: Dimension>(name: &str, a: &Bound<'_, PyAny>, err: PyErr) -> PyErr {
    let ndim = D::NDIM.unwrap_or(0);
    match a.cast::<PyUntypedArray>() {
        Ok(array)
            if array.ndim() == ndim && array.dtype().is_equiv_to(&numpy::dtype::<N>(a.py())) =>
        {
            err
        }
        Ok(array) => PyTypeError::new_err(format!(
            "{name} must be a {ndim}-D {} array (the dtype of the call's first float array), \
             got a {}-D {} array",
            N::NAME,
            array.ndim(),
            array.dtype()
        )),
        Err(_) => PyTypeError::new_err(format!("{name} must be a numpy array")),
    }
}

/// The numpy array's elements as the kernel's element type, without a copy.
pub(super) fn view<N: Dtype, D: Dimension>(a: ArrayView<'_, N, D>) -> ArrayView<'_, N::Kernel, D> {
    cast_view(a)
}

pub(super) fn view_mut<N: Dtype, D: Dimension>(
    a: ArrayViewMut<'_, N, D>,
) -> ArrayViewMut<'_, N::Kernel, D> {
    cast_view_mut(a)
}

/// A KV cache's format as it crosses (`kv_cache_dtype`): the model's float type, or a quantized
/// format's codes (`cpu::kv_quant`: rows of `D` codes and a scale byte).
#[derive(Clone, Copy)]
pub(super) enum KvFormat {
    Auto,
    Bf16,
    Int8,
    Fp8E4M3,
    Fp8E5M2,
}

impl KvFormat {
    pub(super) fn parse(name: &str) -> PyResult<Self> {
        match name {
            "auto" => Ok(KvFormat::Auto),
            "bfloat16" => Ok(KvFormat::Bf16),
            "int8" => Ok(KvFormat::Int8),
            "fp8" | "fp8_e4m3" => Ok(KvFormat::Fp8E4M3),
            "fp8_e5m2" => Ok(KvFormat::Fp8E5M2),
            _ => Err(PyValueError::new_err(format!(
                "kv_cache_dtype must be one of ['auto', 'bfloat16', 'int8', 'fp8', 'fp8_e4m3', \
                 'fp8_e5m2'], got '{name}'"
            ))),
        }
    }

    /// `Auto` as the cache array holds it: a float cache of bfloat16 (uint16 bits) under a
    /// float32 model is `Bf16` (`kv_cache_dtype="bfloat16"`); every other format as it is.
    pub(super) fn of_cache(self, cache: &Bound<'_, PyAny>) -> Self {
        let bf16 = cache
            .cast::<PyUntypedArray>()
            .is_ok_and(|a| a.dtype().is_equiv_to(&numpy::dtype::<u16>(cache.py())));
        match self {
            KvFormat::Auto if bf16 => KvFormat::Bf16,
            other => other,
        }
    }
}

/// The numpy dtype of a cache array and the kernel's element behind it (same size and layout).
pub(super) trait KvDtype: 'static {
    type Numpy: Element + 'static;
    type Kernel: cpu::KvElem + SameLayout<Self::Numpy>;
    const NAME: &'static str;
}

/// The cache in the model's float type `N` (`auto`).
pub(super) struct FloatKv<N>(std::marker::PhantomData<N>);

impl<N: Dtype> KvDtype for FloatKv<N>
where
    N::Kernel: cpu::KvElem,
{
    type Numpy = N;
    type Kernel = N::Kernel;
    const NAME: &'static str = N::NAME;
}

pub(super) struct Int8Kv;

impl KvDtype for Int8Kv {
    type Numpy = i8;
    type Kernel = cpu::I8;
    const NAME: &'static str = "int8 (kv_cache_dtype int8)";
}

pub(super) struct Fp8E4M3Kv;

impl KvDtype for Fp8E4M3Kv {
    type Numpy = u8;
    type Kernel = cpu::Fp8E4M3;
    const NAME: &'static str = "uint8 (kv_cache_dtype fp8_e4m3, its bits)";
}

pub(super) struct Fp8E5M2Kv;

impl KvDtype for Fp8E5M2Kv {
    type Numpy = u8;
    type Kernel = cpu::Fp8E5M2;
    const NAME: &'static str = "uint8 (kv_cache_dtype fp8_e5m2, its bits)";
}

/// Calls `$f::<N, C>($args)` for the float kind of the call and the cache format.
macro_rules! with_kv_format {
    ($kind:expr, $format:expr, $f:ident($($args:expr),*)) => {
        match ($kind, $format) {
            (Kind::F32, KvFormat::Auto) => $f::<f32, FloatKv<f32>>($($args),*),
            (Kind::Bf16, KvFormat::Auto) => $f::<u16, FloatKv<u16>>($($args),*),
            (Kind::F32, KvFormat::Bf16) => $f::<f32, FloatKv<u16>>($($args),*),
            (Kind::Bf16, KvFormat::Bf16) => $f::<u16, FloatKv<u16>>($($args),*),
            (Kind::F32, KvFormat::Int8) => $f::<f32, Int8Kv>($($args),*),
            (Kind::Bf16, KvFormat::Int8) => $f::<u16, Int8Kv>($($args),*),
            (Kind::F32, KvFormat::Fp8E4M3) => $f::<f32, Fp8E4M3Kv>($($args),*),
            (Kind::Bf16, KvFormat::Fp8E4M3) => $f::<u16, Fp8E4M3Kv>($($args),*),
            (Kind::F32, KvFormat::Fp8E5M2) => $f::<f32, Fp8E5M2Kv>($($args),*),
            (Kind::Bf16, KvFormat::Fp8E5M2) => $f::<u16, Fp8E5M2Kv>($($args),*),
        }
    };
}

/// A cache array of the format, 4-D; a TypeError naming what it must be otherwise.
fn kv_cache<'py, C: KvDtype>(
    name: &str,
    a: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray<C::Numpy, ndarray::Ix4>>> {
    a.cast::<PyArray<C::Numpy, ndarray::Ix4>>()
        .cloned()
        .map_err(|_| match a.cast::<PyUntypedArray>() {
            Ok(array) => PyTypeError::new_err(format!(
                "{name} must be a 4-D {} array, got a {}-D {} array",
                C::NAME,
                array.ndim(),
                array.dtype()
            )),
            Err(_) => PyTypeError::new_err(format!("{name} must be a numpy array")),
        })
}

/// As `readwrite`, for a cache array.
fn kv_writeable<'py, C: KvDtype>(
    name: &str,
    a: &Bound<'py, PyArray<C::Numpy, ndarray::Ix4>>,
) -> PyResult<numpy::PyReadwriteArray<'py, C::Numpy, ndarray::Ix4>> {
    a.try_readwrite().map_err(|e| {
        PyValueError::new_err(format!(
            "{name} must be writeable and share no memory with the call's other arrays ({e})"
        ))
    })
}

fn kv_view<C: KvDtype>(
    a: ArrayView<'_, C::Numpy, ndarray::Ix4>,
) -> ArrayView<'_, C::Kernel, ndarray::Ix4> {
    cast_view(a)
}

fn kv_view_mut<C: KvDtype>(
    a: ArrayViewMut<'_, C::Numpy, ndarray::Ix4>,
) -> ArrayViewMut<'_, C::Kernel, ndarray::Ix4> {
    cast_view_mut(a)
}

/// Writes k/v `[T, KVH, D]` into the caches `[blocks, block_size, KVH, D]` at `slot_mapping`
/// (int64 `[T]`, -1 = padding row, skipped); k/v float32, or bfloat16 as uint16. The caches are
/// of k's dtype (`kv_cache_dtype="auto"`), or quantized (`"int8"`: int8, `"fp8_e4m3"` /
/// `"fp8_e5m2"`: uint8 bits), `[blocks, block_size, KVH, D + 1]`, each row coded with its scale byte.
/// `key_feedback` (float32 `[KVH, D, D]`, a quantized cache): the keys' codes chosen by error
/// feedback (`cpu::store_kv_fed`, the key calibration's matrices).
#[pyfunction]
#[pyo3(signature = (
    k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype = "auto", key_feedback = None
))]
#[allow(clippy::too_many_arguments)]
fn cpu_store_kvcache(
    py: Python<'_>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    slot_mapping: PyReadonlyArray1<'_, i64>,
    kv_cache_dtype: &str,
    key_feedback: Option<PyReadonlyArrayDyn<'_, f32>>,
) -> PyResult<()> {
    let format = KvFormat::parse(kv_cache_dtype)?.of_cache(k_cache);
    let feedback = match &key_feedback {
        Some(f) => Some(
            f.as_slice()
                .map_err(|_| PyValueError::new_err("key_feedback must be contiguous"))?,
        ),
        None => None,
    };
    with_kv_format!(
        Kind::of("k", k)?,
        format,
        store(py, k, v, k_cache, v_cache, slot_mapping, feedback)
    )
}

#[allow(clippy::too_many_arguments)]
fn store<N: Dtype, C: KvDtype>(
    py: Python<'_>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    slot_mapping: PyReadonlyArray1<'_, i64>,
    key_feedback: Option<&[f32]>,
) -> PyResult<()> {
    let slots = contiguous("slot_mapping", &slot_mapping)?;
    let (k, v) = (readonly::<N, _>("k", k)?, readonly::<N, _>("v", v)?);
    let (kc, vc) = (
        kv_cache::<C>("k_cache", k_cache)?,
        kv_cache::<C>("v_cache", v_cache)?,
    );
    let mut kc = kv_writeable::<C>("k_cache", &kc)?;
    let mut vc = kv_writeable::<C>("v_cache", &vc)?;
    let (k, v) = (view(k.as_array()), view(v.as_array()));
    let (kc, vc) = (
        kv_view_mut::<C>(kc.as_array_mut()),
        kv_view_mut::<C>(vc.as_array_mut()),
    );
    py.detach(|| cpu::store_kv_fed(k, v, slots, kc, vc, key_feedback))?;
    Ok(())
}

/// Paged attention of q `[T, H, D]` over the caches into `out` `[T, H, D]` (contiguous), causal
/// within each sequence's query rows; `num_threads` workers at most. q and out are float32 or
/// bfloat16 as uint16; the caches of their dtype, or quantized (`kv_cache_dtype`, as in
/// `cpu_store_kvcache`), read in place and dequantized in registers. `sliding_window` W > 0: a
/// query sees only the last W positions (older blocks are not read); `softcap` > 0: scores
/// capped as `softcap * tanh(score / softcap)`.
#[pyfunction]
#[pyo3(signature = (
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out, num_threads,
    kv_cache_dtype = "auto", sliding_window = 0, softcap = 0.0
))]
#[allow(clippy::too_many_arguments)]
fn cpu_paged_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    query_start_loc: PyReadonlyArray1<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    scale: f32,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
    kv_cache_dtype: &str,
    sliding_window: usize,
    softcap: f32,
) -> PyResult<()> {
    let format = KvFormat::parse(kv_cache_dtype)?.of_cache(k_cache);
    let floats = (q, k_cache, v_cache, out);
    let ints = (query_start_loc, seq_lens, block_tables);
    let scores = Scores {
        scale,
        window: sliding_window,
        softcap,
    };
    with_kv_format!(
        Kind::of("q", q)?,
        format,
        attend(py, floats, ints, scores, num_threads)
    )
}

type Floats<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
);

type Ints<'py> = (
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray1<'py, i32>,
    PyReadonlyArray2<'py, i32>,
);

fn attend<N: Dtype, C: KvDtype>(
    py: Python<'_>,
    (q, k_cache, v_cache, out): Floats<'_, '_>,
    (query_start_loc, seq_lens, block_tables): Ints<'_>,
    scores: Scores,
    num_threads: usize,
) -> PyResult<()> {
    let q = readonly::<N, ndarray::Ix3>("q", q)?;
    let kc = kv_cache::<C>("k_cache", k_cache)?;
    let vc = kv_cache::<C>("v_cache", v_cache)?;
    let (kc, vc) = (kc.readonly(), vc.readonly());
    let mut out = readwrite::<N, ndarray::Ix3>("out", out)?;
    let batch = PagedBatch {
        query_start_loc: contiguous("query_start_loc", &query_start_loc)?,
        seq_lens: contiguous("seq_lens", &seq_lens)?,
        block_tables: block_tables.as_array(),
    };
    let q = view(q.as_array());
    let (kc, vc) = (kv_view::<C>(kc.as_array()), kv_view::<C>(vc.as_array()));
    let out = view_mut(out.as_array_mut());
    py.detach(|| cpu::paged_attention(q, kc, vc, batch, scores, out, num_threads))?;
    Ok(())
}

/// Rotates the heads of x `[T, heads, D]` (each head contiguous; e.g. the q/k columns of the
/// fused projection) in place by cos/sin `[T, D / 2]`: halves (a, b) -> (a·cos − b·sin,
/// b·cos + a·sin). x, cos and sin all float32 or all bfloat16 as uint16.
#[pyfunction]
fn cpu_rotary_in_place(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
) -> PyResult<()> {
    match Kind::of("x", x)? {
        Kind::F32 => rotate::<f32>(py, x, cos, sin),
        Kind::Bf16 => rotate::<u16>(py, x, cos, sin),
    }
}

fn rotate<N: Dtype>(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut x = readwrite::<N, ndarray::Ix3>("x", x)?;
    let cos = readonly::<N, ndarray::Ix2>("cos", cos)?;
    let sin = readonly::<N, ndarray::Ix2>("sin", sin)?;
    let x = view_mut(x.as_array_mut());
    let (cos, sin) = (view(cos.as_array()), view(sin.as_array()));
    py.detach(|| cpu::rotary_in_place(x, cos, sin))?;
    Ok(())
}

/// The panels per group (`cpu::linear::panel_group`: 4, or 1 for plain panels) in which
/// `cpu_linear` and `cpu_moe_experts` read `panels` panels of `k` rows of `dtype` ("float32" or
/// "bfloat16") fastest on this machine.
#[pyfunction]
fn cpu_panel_group(dtype: &str, panels: usize, k: usize) -> PyResult<usize> {
    match dtype {
        "float32" => Ok(cpu::linear::panel_group::<f32>(panels, k)),
        "bfloat16" => Ok(cpu::linear::panel_group::<cpu::Bf16>(panels, k)),
        other => Err(PyValueError::new_err(format!(
            "dtype {other:?} is neither 'float32' nor 'bfloat16'"
        ))),
    }
}

/// `out [M, N] = x [M, K] · W^T (+ bias [N])` with W as its panels `[ceil(N / 16), K, 16]`
/// (`crate::cpu::linear`); `num_threads` workers at most. x, the panels, bias and out all
/// float32 or all bfloat16 as uint16, contiguous.
#[pyfunction]
#[pyo3(signature = (x, panels, bias, out, num_threads))]
fn cpu_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    panels: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    match Kind::of("x", x)? {
        Kind::F32 => multiply::<f32>(py, (x, panels, bias, out), num_threads),
        Kind::Bf16 => multiply::<u16>(py, (x, panels, bias, out), num_threads),
    }
}

type LinearArgs<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    Option<&'a Bound<'py, PyAny>>,
    &'a Bound<'py, PyAny>,
);

fn multiply<N: Dtype>(
    py: Python<'_>,
    (x, panels, bias, out): LinearArgs<'_, '_>,
    num_threads: usize,
) -> PyResult<()> {
    let x = readonly::<N, ndarray::Ix2>("x", x)?;
    let panels = readonly::<N, ndarray::Ix3>("panels", panels)?;
    let bias = bias
        .map(|b| readonly::<N, ndarray::Ix1>("bias", b))
        .transpose()?;
    let mut out = readwrite::<N, ndarray::Ix2>("out", out)?;
    let bias = bias
        .as_ref()
        .map(|b| contiguous_view("bias", view(b.as_array())))
        .transpose()?;
    let (x, panels) = (view(x.as_array()), view(panels.as_array()));
    let out = view_mut(out.as_array_mut());
    py.detach(|| cpu::linear(x, panels, bias, out, num_threads))?;
    Ok(())
}

/// RMS norm of every row of x `[T, E]` into out `[T, E]` by weight `[E]` (`crate::cpu::norm`);
/// all float32 or all bfloat16 as uint16, contiguous.
#[pyfunction]
fn cpu_rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    match Kind::of("x", x)? {
        Kind::F32 => normalize::<f32>(py, x, weight, eps, out),
        Kind::Bf16 => normalize::<u16>(py, x, weight, eps, out),
    }
}

fn normalize<N: Dtype>(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = readonly::<N, ndarray::Ix2>("x", x)?;
    let weight = readonly::<N, ndarray::Ix1>("weight", weight)?;
    let mut out = readwrite::<N, ndarray::Ix2>("out", out)?;
    let weight = contiguous_view("weight", view(weight.as_array()))?;
    let x = view(x.as_array());
    let out = view_mut(out.as_array_mut());
    py.detach(|| cpu::rms_norm(x, weight, eps, out))?;
    Ok(())
}

/// The residual step between two blocks, in place: `residual += x`, then `x = rms_norm(residual)`
/// by weight `[E]` (`crate::cpu::norm::add_rms_norm`); x and residual `[T, E]`, distinct; all
/// float32 or all bfloat16 as uint16, contiguous.
#[pyfunction]
fn cpu_add_rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    match Kind::of("x", x)? {
        Kind::F32 => add_normalize::<f32>(py, x, residual, weight, eps),
        Kind::Bf16 => add_normalize::<u16>(py, x, residual, weight, eps),
    }
}

fn add_normalize<N: Dtype>(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let mut x = readwrite::<N, ndarray::Ix2>("x", x)?;
    let mut residual = readwrite::<N, ndarray::Ix2>("residual", residual)?;
    let weight = readonly::<N, ndarray::Ix1>("weight", weight)?;
    let weight = contiguous_view("weight", view(weight.as_array()))?;
    let x = view_mut(x.as_array_mut());
    let residual = view_mut(residual.as_array_mut());
    py.detach(|| cpu::add_rms_norm(x, residual, weight, eps))?;
    Ok(())
}

/// `out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]` (`crate::cpu::activation`); gate_up
/// `[T, 2I]`; `num_threads` workers at most; both float32 or both bfloat16 as uint16,
/// contiguous.
#[pyfunction]
fn cpu_silu_and_mul(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    match Kind::of("gate_up", gate_up)? {
        Kind::F32 => activate::<f32>(py, gate_up, out, num_threads),
        Kind::Bf16 => activate::<u16>(py, gate_up, out, num_threads),
    }
}

fn activate<N: Dtype>(
    py: Python<'_>,
    gate_up: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let gate_up = readonly::<N, ndarray::Ix2>("gate_up", gate_up)?;
    let mut out = readwrite::<N, ndarray::Ix2>("out", out)?;
    let gate_up = view(gate_up.as_array());
    let out = view_mut(out.as_array_mut());
    py.detach(|| cpu::silu_and_mul(gate_up, out, num_threads))?;
    Ok(())
}

/// `out[r]` = the index of row r's largest logit (the first on ties, the first NaN if any) of
/// float32 `logits` `[K, V]` (contiguous) into int64 `out` `[K]`; `num_threads` workers at most.
#[pyfunction]
fn cpu_argmax(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    out: &Bound<'_, PyAny>,
    num_threads: usize,
) -> PyResult<()> {
    let mut out = out
        .cast::<PyArray1<i64>>()
        .map_err(|_| PyTypeError::new_err("out must be a 1-D int64 numpy array"))?
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out must be writeable ({e})")))?;
    let out = out
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("out must be contiguous"))?;
    let logits = logits.as_array();
    py.detach(|| cpu::argmax_rows(logits, out, num_threads))?;
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_store_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_rotary_in_place, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_linear, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_panel_group, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_argmax, m)?)?;
    Ok(())
}
