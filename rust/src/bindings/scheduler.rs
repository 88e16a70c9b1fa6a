//! Python face of the scheduler: `Scheduler` and `SchedulerOutput`.
//!
//! Step arrays cross as numpy arrays built lazily on first access (bytes copied into a
//! `bytearray`, then `numpy.frombuffer`, so they are writable and torch can take them), so a
//! step whose arrays are never read costs no Python objects. Sampled tokens come back through
//! the buffer protocol (an int64 numpy array is read without conversion; lists are read item
//! by item, other arrays converted once; anything that is not integers is refused, never
//! truncated).
use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyByteArray, PyDict, PyInt, PyList, PyString, PyTuple};

use super::errors::{non_negative, PagedLLMError};
use crate::ids::TokenId;
use crate::kv::CacheConfig;
use crate::scheduler::{
    Policy, PreemptionMode, RequestParams, Scheduler, SchedulerConfig, StepOutput, StopParams,
    Strategy,
};

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    NUMPY
        .get_or_try_init(py, || Ok(py.import("numpy")?.unbind()))
        .map(|m| m.bind(py))
}

/// Seconds on the `time.time()` clock (the clock of default arrival times).
fn wall_clock() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A numpy array of `dtype` over a copy of `data`, optionally reshaped to `rows` x `cols`.
fn np_array<T: Copy>(
    py: Python<'_>,
    data: &[T],
    dtype: &str,
    shape: Option<(usize, usize)>,
) -> PyResult<Py<PyAny>> {
    // SAFETY: T is a plain integer type; its bytes are read, not reinterpreted as anything
    // else on this side.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
    };
    let buf = PyByteArray::new(py, bytes);
    let mut arr = numpy(py)?.call_method1("frombuffer", (buf, dtype))?;
    if let Some((rows, cols)) = shape {
        arr = arr.call_method1("reshape", ((rows, cols),))?;
    }
    Ok(arr.unbind())
}

/// A Python int (or int subclass, or numpy integer scalar) that is not a bool: what an
/// integer argument or token id may be. Floats, strings, None and bools are refused, never
/// truncated.
fn is_integer(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if obj.is_instance_of::<PyBool>() {
        return Ok(false);
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(true);
    }
    obj.is_instance(&numpy(obj.py())?.getattr("integer")?)
}

/// `obj` (checked by `is_integer`) as an i128 when it fits i64 or u64; None beyond both.
fn integer_value(obj: &Bound<'_, PyAny>) -> Option<i128> {
    let int = obj.call_method0("__index__").ok()?;
    int.extract::<i64>()
        .map(i128::from)
        .or_else(|_| int.extract::<u64>().map(i128::from))
        .ok()
}

/// An integer argument within `[lo, hi]` (`limit` says where `hi` comes from, if anywhere):
/// a `ValueError` naming the request, the field and the bound otherwise, never pyo3's bare
/// `OverflowError` or a truncated float.
fn int_arg(
    obj: &Bound<'_, PyAny>,
    id: &str,
    name: &str,
    (lo, hi): (i128, i128),
    limit: &str,
) -> PyResult<i128> {
    let bad = |m: String| PyValueError::new_err(format!("request {id:?}: {name} {m}"));
    if !is_integer(obj)? {
        return Err(bad(format!(
            "must be an int, got {} {}",
            obj.get_type().name()?,
            obj.repr()?
        )));
    }
    match integer_value(obj) {
        Some(v) if v < lo => Err(bad(format!("must be >= {lo}, got {v}"))),
        Some(v) if v <= hi => Ok(v),
        _ if obj.lt(0)? => Err(bad(format!("must be >= {lo}, got {}", obj.repr()?))),
        _ => Err(bad(format!("must be <= {hi}{limit}, got {}", obj.repr()?))),
    }
}

/// Range of the integer arguments held as `usize` / `i64` on the Rust side (one limit for
/// all, so every count fits either).
const I64_RANGE: (i128, i128) = (i64::MIN as i128, i64::MAX as i128);

/// An integer argument taken as any object, so that `int_arg` (not pyo3's conversion, whose
/// overflow is a bare `OverflowError` and which would not name the request) checks it.
pub(crate) enum IntArg<'py> {
    Given(Bound<'py, PyAny>),
    Default(i128),
}

impl<'py> FromPyObject<'py> for IntArg<'py> {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(IntArg::Given(ob.clone()))
    }
}

impl IntArg<'_> {
    fn get(&self, id: &str, name: &str, range: (i128, i128), limit: &str) -> PyResult<i128> {
        match self {
            IntArg::Given(obj) => int_arg(obj, id, name, range, limit),
            IntArg::Default(v) => Ok(*v),
        }
    }
}

/// Item `i` of a token list: an integer in the i64 range, else a `ValueError` naming the
/// position and the value.
fn int_item(item: &Bound<'_, PyAny>, what: &str, i: usize) -> PyResult<i64> {
    if item.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = item.extract::<i64>() {
            return Ok(v);
        }
    } else if !is_integer(item)? {
        return Err(PyValueError::new_err(format!(
            "{what}[{i}] must be an int, got {} {}",
            item.get_type().name()?,
            item.repr()?
        )));
    }
    integer_value(item)
        .and_then(|v| i64::try_from(v).ok())
        .ok_or_else(|| {
            let shown = item.repr().map(|r| r.to_string()).unwrap_or_default();
            PyValueError::new_err(format!("{what}[{i}] = {shown} is out of range"))
        })
}

/// Reads a 1-D integer array-like as i64, refusing anything that is not integers (floats,
/// bools, strings, None are never truncated or coerced): int64 buffers directly, lists and
/// tuples item by item (Python ints or numpy integer scalars), anything else through one
/// `numpy.asarray` call whose dtype must be an integer one.
fn read_i64(obj: &Bound<'_, PyAny>, what: &str, into: &mut Vec<i64>) -> PyResult<()> {
    let py = obj.py();
    into.clear();
    if let Ok(b) = PyBuffer::<i64>::get(obj) {
        if b.dimensions() == 1 && b.is_c_contiguous() {
            into.resize(b.item_count(), 0);
            return b.copy_to_slice(py, into);
        }
    }
    if let Ok(list) = obj.downcast::<PyList>() {
        into.reserve(list.len());
        for (i, item) in list.iter().enumerate() {
            into.push(int_item(&item, what, i)?);
        }
        return Ok(());
    }
    if let Ok(tuple) = obj.downcast::<PyTuple>() {
        into.reserve(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            into.push(int_item(&item, what, i)?);
        }
        return Ok(());
    }
    let not_a_list = || -> PyResult<PyErr> {
        Ok(PyValueError::new_err(format!(
            "{what} must be a list or numpy array of ints, got {} {}",
            obj.get_type().name()?,
            obj.repr()?
        )))
    };
    if obj.is_instance_of::<PyString>() {
        return Err(not_a_list()?);
    }
    let np = numpy(py)?;
    let arr = match np.call_method1("asarray", (obj,)) {
        Ok(arr) => arr,
        Err(_) => return Err(not_a_list()?),
    };
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if ndim == 0 {
        return Err(not_a_list()?);
    }
    if ndim != 1 {
        return Err(PyValueError::new_err(format!(
            "{what} must be one-dimensional, got {ndim} dimensions"
        )));
    }
    if arr.getattr("size")?.extract::<usize>()? == 0 {
        return Ok(());
    }
    let dtype = arr.getattr("dtype")?;
    let kind: String = dtype.getattr("kind")?.extract()?;
    if kind != "i" && kind != "u" {
        return Err(PyValueError::new_err(format!(
            "{what} must be integers (an int list or an integer-dtype array), got dtype {}",
            dtype.str()?
        )));
    }
    if kind == "u" && arr.call_method0("max")?.gt(i64::MAX)? {
        return Err(PyValueError::new_err(format!(
            "{what} holds a value above {} (out of range)",
            i64::MAX
        )));
    }
    let arr = np.call_method1("ascontiguousarray", (arr, "int64"))?;
    let buf = PyBuffer::<i64>::get(&arr)?;
    into.resize(buf.item_count(), 0);
    buf.copy_to_slice(py, into)
}

fn read_flags(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<bool>> {
    let py = obj.py();
    let arr = numpy(py)?
        .call_method1("asarray", (obj, "uint8"))
        .map_err(|e| PyValueError::new_err(format!("{what} must be booleans: {e}")))?;
    let buf = PyBuffer::<u8>::get(&arr.call_method0("ravel")?)?;
    let mut v = vec![0u8; buf.item_count()];
    buf.copy_to_slice(py, &mut v)?;
    Ok(v.into_iter().map(|b| b != 0).collect())
}

/// The scheduler of SPEC §4, usable without a model: add requests, `schedule()`, feed back
/// sampled tokens with `update_from_output`, abort, read queues and stats.
#[pyclass(name = "Scheduler", module = "pagedllm._core")]
pub(crate) struct PyScheduler {
    inner: Scheduler,
    /// Per request slot: (generation, id as a Python string), so outputs list request ids
    /// without building strings.
    py_ids: Vec<(u32, Py<PyString>)>,
    token_scratch: Vec<i64>,
    strategy: &'static str,
    policy: &'static str,
    preemption_mode: Option<&'static str>,
}

impl PyScheduler {
    /// Python strings of the requests an output names by (slot, generation).
    fn id_list(&self, py: Python<'_>, handles: &[u32], gens: &[u32]) -> PyResult<Py<PyAny>> {
        let mut items = Vec::with_capacity(handles.len());
        for (&h, &g) in handles.iter().zip(gens) {
            match self.py_ids.get(h as usize) {
                Some((gen, s)) if *gen == g => items.push(s.clone_ref(py)),
                _ => {
                    return Err(PagedLLMError::new_err(
                        "stale SchedulerOutput: its requests' slots were reused by newer \
                         requests; read request ids before thousands of requests turn over",
                    ))
                }
            }
        }
        Ok(PyList::new(py, items)?.into_any().unbind())
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (*, num_gpu_blocks, block_size = 16, num_cpu_blocks = 0,
                        max_num_batched_tokens = None, max_num_seqs = 256, max_model_len = 2048,
                        scheduling = "unified", policy = "fcfs", preemption_mode = None,
                        enable_prefix_caching = true, watermark = 0.01,
                        long_prefill_token_threshold = 0, num_lookahead_slots = 0,
                        delay_factor = 0.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: i64,
        block_size: i64,
        num_cpu_blocks: i64,
        max_num_batched_tokens: Option<i64>,
        max_num_seqs: i64,
        max_model_len: i64,
        scheduling: &str,
        policy: &str,
        preemption_mode: Option<&str>,
        enable_prefix_caching: bool,
        watermark: f64,
        long_prefill_token_threshold: i64,
        num_lookahead_slots: i64,
        delay_factor: f64,
    ) -> PyResult<Self> {
        let strategy = Strategy::parse(scheduling)?;
        let pol = Policy::parse(policy)?;
        let mode = PreemptionMode::parse(preemption_mode)?;
        let budget = match max_num_batched_tokens {
            None => 0,
            Some(v) if v >= 1 => v as usize,
            Some(v) => {
                return Err(PyValueError::new_err(format!(
                    "max_num_batched_tokens must be >= 1 (or None), got {v}"
                )))
            }
        };
        let cache = CacheConfig {
            block_size: non_negative("block_size", block_size)?,
            num_device_blocks: non_negative("num_gpu_blocks", num_gpu_blocks)?,
            num_host_blocks: non_negative("num_cpu_blocks", num_cpu_blocks)?,
            watermark,
            enable_prefix_caching,
        };
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: non_negative("max_num_seqs", max_num_seqs)?,
            max_model_len: non_negative("max_model_len", max_model_len)?,
            strategy,
            policy: pol,
            preemption_mode: mode,
            long_prefill_token_threshold: non_negative(
                "long_prefill_token_threshold",
                long_prefill_token_threshold,
            )?,
            num_lookahead_slots: non_negative("num_lookahead_slots", num_lookahead_slots)?,
            delay_factor,
        };
        Ok(PyScheduler {
            inner: Scheduler::new(cache, cfg)?,
            py_ids: Vec::new(),
            token_scratch: Vec::new(),
            strategy: match strategy {
                Strategy::PrefillFirst => "prefill_first",
                Strategy::ChunkedPrefill => "chunked_prefill",
                Strategy::Unified => "unified",
            },
            policy: match pol {
                Policy::Fcfs => "fcfs",
                Policy::Priority => "priority",
            },
            preemption_mode: match mode {
                PreemptionMode::Auto => None,
                PreemptionMode::Recompute => Some("recompute"),
                PreemptionMode::Swap => Some("swap"),
            },
        })
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(scheduling={:?}, policy={:?}, preemption_mode={:?}, block_size={}, \
             max_num_batched_tokens={}, max_num_seqs={}, max_model_len={}, waiting={}, \
             running={}, swapped={})",
            self.strategy,
            self.policy,
            self.preemption_mode,
            self.inner.block_size(),
            c.max_num_batched_tokens,
            c.max_num_seqs,
            c.max_model_len,
            self.inner.num_waiting(),
            self.inner.num_running(),
            self.inner.num_swapped()
        )
    }

    /// Queues a request. ValueError (naming the request, the field and its limit) for an
    /// empty prompt, a duplicate id, `n` above `max_num_seqs`, token ids that are not
    /// integers (floats, bools, strings are refused, never truncated), integers outside their
    /// range, or bad limits; TypeError for a `request_id` that is not a str. Nothing is queued
    /// then. A request that can never be served (prompt too long, more blocks than the
    /// cache) is reported by the next `schedule()` in `finished`, with the reason.
    #[pyo3(signature = (request_id, prompt_token_ids, *, n = IntArg::Default(1),
                        priority = IntArg::Default(0), arrival_time = None,
                        max_tokens = IntArg::Default(16), min_tokens = IntArg::Default(0),
                        eos_token_id = None, stop_token_ids = None, ignore_eos = false,
                        extra_key = IntArg::Default(0)),
           text_signature = "($self, request_id, prompt_token_ids, *, n=1, priority=0, \
                             arrival_time=None, max_tokens=16, min_tokens=0, \
                             eos_token_id=None, stop_token_ids=None, ignore_eos=False, \
                             extra_key=0)")]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        n: IntArg<'_>,
        priority: IntArg<'_>,
        arrival_time: Option<f64>,
        max_tokens: IntArg<'_>,
        min_tokens: IntArg<'_>,
        eos_token_id: Option<IntArg<'_>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        extra_key: IntArg<'_>,
    ) -> PyResult<()> {
        let request_id = request_id.downcast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "request_id must be a str, got {} {}",
                request_id
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
                request_id.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        let id = request_id.to_str()?;
        let named = |m: String| PyValueError::new_err(format!("request {id:?}: {m}"));
        let token = |t: i64, what: &str| {
            TokenId::try_from(t).map_err(|_| named(format!("{what} {t} is not a valid token id")))
        };
        // n < 1 passes here and is refused by the core with its own message
        let max_seqs = self.inner.config().max_num_seqs as i128;
        let n = n.get(id, "n", (I64_RANGE.0, max_seqs), " (max_num_seqs)")?;
        let count = |arg: IntArg<'_>, what: &str, lo: i128| {
            arg.get(id, what, (lo, I64_RANGE.1), "").map(|v| v as usize)
        };
        let max_tokens = count(max_tokens, "max_tokens", 1)?;
        let min_tokens = count(min_tokens, "min_tokens", 0)?;
        let priority = priority.get(id, "priority", I64_RANGE, "")? as i64;
        let extra_key = extra_key.get(id, "extra_key", (0, u64::MAX as i128), "")? as u64;
        let eos_token_id = eos_token_id
            .map(|t| {
                t.get(
                    id,
                    "eos_token_id",
                    (0, TokenId::MAX as i128),
                    " (a token id)",
                )
            })
            .transpose()?
            .map(|t| t as TokenId);
        let mut raw = Vec::new();
        read_i64(
            prompt_token_ids,
            &format!("request {id:?}: prompt_token_ids"),
            &mut raw,
        )?;
        let prompt = raw
            .iter()
            .map(|&t| token(t, "prompt token"))
            .collect::<PyResult<Vec<_>>>()?;
        let stop_ids = match stop_token_ids {
            None => Vec::new(),
            Some(obj) => {
                read_i64(obj, &format!("request {id:?}: stop_token_ids"), &mut raw)?;
                raw.iter()
                    .map(|&t| token(t, "stop token"))
                    .collect::<PyResult<Vec<_>>>()?
            }
        };
        let params = RequestParams {
            prompt,
            n: usize::try_from(n).unwrap_or(0),
            priority,
            arrival_time: arrival_time.unwrap_or_else(wall_clock),
            stop: StopParams {
                max_tokens,
                min_tokens,
                eos_token_id,
                stop_token_ids: stop_ids,
                ignore_eos,
            },
            extra_key,
        };
        let h = self.inner.add_request(id, params)? as usize;
        let gen = self.inner.slot_generation(h as u32);
        let entry = (gen, request_id.clone().unbind());
        if h < self.py_ids.len() {
            self.py_ids[h] = entry;
        } else {
            self.py_ids.push(entry);
        }
        Ok(())
    }

    /// Decides the next step (`now`: seconds on the arrival-time clock, default
    /// `time.time()`; only `delay_factor` reads it). Raises PagedLLMError while the previous
    /// output's samples have not been fed back.
    #[pyo3(signature = (now = None))]
    fn schedule(slf: &Bound<'_, Self>, now: Option<f64>) -> PyResult<PySchedulerOutput> {
        let out = slf
            .borrow_mut()
            .inner
            .schedule(now.unwrap_or_else(wall_clock))?;
        Ok(PySchedulerOutput::new(out, slf.clone().unbind()))
    }

    /// Feeds back one sampled token per sample of `output` (the latest one), aligned with
    /// `output.sample_seq_ids`: an int64 numpy array is read as is, other integer arrays or
    /// lists of ints are converted once; a float or bool array is a ValueError. `stop_string_hit` (optional, bool per sample) finishes that
    /// sequence as stopped. Returns `(request_id, seq_index, finish_reason, stop_reason,
    /// request_finished)` for each sequence that finished.
    #[pyo3(signature = (output, sampled_token_ids, stop_string_hit = None))]
    fn update_from_output(
        &mut self,
        py: Python<'_>,
        output: PyRef<'_, PySchedulerOutput>,
        sampled_token_ids: &Bound<'_, PyAny>,
        stop_string_hit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyList>> {
        let mut tokens = std::mem::take(&mut self.token_scratch);
        let read = read_i64(sampled_token_ids, "sampled_token_ids", &mut tokens);
        let result = read.and_then(|()| {
            let hits = stop_string_hit
                .map(|h| read_flags(h, "stop_string_hit"))
                .transpose()?;
            Ok(self
                .inner
                .update_from_output(output.out.step, &tokens, hits.as_deref())?)
        });
        self.token_scratch = tokens;
        let list = PyList::empty(py);
        for f in result? {
            let item = PyTuple::new(
                py,
                [
                    f.request_id.into_pyobject(py)?.into_any(),
                    f.seq_index.into_pyobject(py)?.into_any(),
                    f.reason.as_str().into_pyobject(py)?.into_any(),
                    f.stop_reason.into_pyobject(py)?.into_any(),
                    pyo3::types::PyBool::new(py, f.request_finished)
                        .to_owned()
                        .into_any(),
                ],
            )?;
            list.append(item)?;
        }
        Ok(list.unbind())
    }

    /// Aborts one id (a str) or an iterable of them from whichever queue holds them,
    /// freeing their blocks. Unknown and finished ids are ignored. Anything else (an int, an
    /// iterable holding a non-str) is a TypeError, raised before any request is aborted.
    fn abort_request(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(id) = request_id.downcast::<PyString>() {
            self.inner.abort_request(id.to_str()?)?;
            return Ok(());
        }
        let not_ids = |what: &Bound<'_, PyAny>| {
            PyTypeError::new_err(format!(
                "abort_request takes a request id (str) or an iterable of them, got {} {}",
                what.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
                what.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        };
        let mut ids = Vec::new();
        for item in request_id.try_iter().map_err(|_| not_ids(request_id))? {
            let item = item?;
            let id = item.downcast::<PyString>().map_err(|_| not_ids(&item))?;
            ids.push(id.to_str()?.to_owned());
        }
        for id in &ids {
            self.inner.abort_request(id)?;
        }
        Ok(())
    }

    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    fn num_swapped(&self) -> usize {
        self.inner.num_swapped()
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Request ids in queue order.
    fn waiting_ids(&self) -> Vec<String> {
        self.inner
            .waiting_ids()
            .into_iter()
            .map(String::from)
            .collect()
    }

    fn running_ids(&self) -> Vec<String> {
        self.inner
            .running_ids()
            .into_iter()
            .map(String::from)
            .collect()
    }

    fn swapped_ids(&self) -> Vec<String> {
        self.inner
            .swapped_ids()
            .into_iter()
            .map(String::from)
            .collect()
    }

    /// "WAITING", "RUNNING", "SWAPPED", "PREEMPTED" or "FINISHED_IGNORED" (until reported)
    /// for a live request; None for unknown and finished ones.
    fn request_status(&self, request_id: &str) -> Option<&'static str> {
        self.inner.request_status(request_id).map(|s| s.as_str())
    }

    /// Prompt tokens served by the prefix cache at the request's first admission (None for
    /// unknown or finished requests).
    fn num_cached_tokens(&self, request_id: &str) -> Option<usize> {
        self.inner.request(request_id).map(|r| r.num_cached_tokens)
    }

    /// Queue lengths, KV usage, prefix-cache counters (in blocks), preemptions by mode.
    fn get_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let c = &s.counters;
        let pc = &s.cache.prefix_cache;
        let d = PyDict::new(py);
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_swapped", s.num_swapped)?;
        d.set_item("num_running_seqs", s.num_running_seqs)?;
        d.set_item("kv_usage", s.cache.device_usage)?;
        d.set_item("cpu_kv_usage", s.cache.host_usage)?;
        d.set_item("num_gpu_blocks", s.cache.num_device_blocks)?;
        d.set_item("num_cpu_blocks", s.cache.num_host_blocks)?;
        d.set_item("num_free_gpu_blocks", s.cache.num_free_device_blocks)?;
        d.set_item("num_free_cpu_blocks", s.cache.num_free_host_blocks)?;
        d.set_item("num_cached_gpu_blocks", s.cache.num_cached_device_blocks)?;
        d.set_item("prefix_cache_queries", pc.queries)?;
        d.set_item("prefix_cache_query_blocks", pc.query_blocks)?;
        d.set_item("prefix_cache_hits", pc.hits)?;
        d.set_item("prefix_cache_misses", pc.misses)?;
        d.set_item("prefix_cache_evictions", pc.evictions)?;
        d.set_item("prefix_cache_hit_rate", pc.hit_rate())?;
        d.set_item(
            "num_preemptions",
            c.num_preemptions_recompute + c.num_preemptions_swap,
        )?;
        d.set_item("num_preemptions_recompute", c.num_preemptions_recompute)?;
        d.set_item("num_preemptions_swap", c.num_preemptions_swap)?;
        d.set_item("num_steps", c.num_steps)?;
        d.set_item("num_finished", c.num_finished)?;
        d.set_item("num_ignored", c.num_ignored)?;
        d.set_item("num_aborted", c.num_aborted)?;
        d.set_item("num_batched_tokens_total", c.num_batched_tokens_total)?;
        d.set_item("num_rolled_back_steps", c.num_rolled_back_steps)?;
        Ok(d)
    }

    /// Takes back `output` (the latest step, not yet applied) when it could not be computed:
    /// its requests, and the groups it swapped out, go back to the head of `waiting` to be
    /// recomputed (generated tokens kept); blocks it registered in the prefix cache are
    /// forgotten. Returns the ids of the requests rolled back. PagedLLMError if `output` is
    /// not the latest step or was already applied or discarded.
    fn discard_step(&mut self, output: PyRef<'_, PySchedulerOutput>) -> PyResult<Vec<String>> {
        Ok(self.inner.discard_step(&output.out)?)
    }

    /// Raises PagedLLMError naming the first broken invariant (manager and queues).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(PagedLLMError::new_err)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.config().max_num_batched_tokens
    }

    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.config().max_num_seqs
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }

    #[getter]
    fn scheduling(&self) -> &'static str {
        self.strategy
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.policy
    }

    #[getter]
    fn preemption_mode(&self) -> Option<&'static str> {
        self.preemption_mode
    }
}

/// One step's work as arrays (ARCHITECTURE §2). Arrays are built on first access and cached.
/// Data movement order for the runner: swap out, swap in, copy, then the forward pass.
#[pyclass(name = "SchedulerOutput", module = "pagedllm._core")]
pub(crate) struct PySchedulerOutput {
    out: StepOutput,
    sched: Py<PyScheduler>,
    cache: [Option<Py<PyAny>>; FIELDS],
}

const FIELDS: usize = 20;

impl PySchedulerOutput {
    fn new(out: StepOutput, sched: Py<PyScheduler>) -> Self {
        PySchedulerOutput {
            out,
            sched,
            cache: Default::default(),
        }
    }

    /// The cached value of field `i`, built by `make` on first access.
    fn cached(
        &mut self,
        py: Python<'_>,
        i: usize,
        make: impl FnOnce(&StepOutput, &Py<PyScheduler>) -> PyResult<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(v) = &self.cache[i] {
            return Ok(v.clone_ref(py));
        }
        let v = make(&self.out, &self.sched)?;
        self.cache[i] = Some(v.clone_ref(py));
        Ok(v)
    }
}

impl Drop for PySchedulerOutput {
    /// Hands the buffers back to the scheduler (when it is not busy) so the next steps
    /// allocate nothing; numpy arrays already built are copies and stay valid.
    fn drop(&mut self) {
        let out = std::mem::take(&mut self.out);
        Python::attach(|py| {
            if let Ok(mut sched) = self.sched.bind(py).try_borrow_mut() {
                sched.inner.recycle(out);
            }
        });
    }
}

#[pymethods]
impl PySchedulerOutput {
    fn __repr__(&self) -> String {
        let o = &self.out;
        format!(
            "SchedulerOutput(step={}, num_seqs={}, num_batched_tokens={}, num_samples={}, \
             copies={}, swap_out={}, swap_in={}, preempted={:?}, finished={})",
            o.step,
            o.num_seqs(),
            o.num_batched_tokens,
            o.num_samples(),
            o.blocks_to_copy.len() / 2,
            o.blocks_to_swap_out.len() / 2,
            o.blocks_to_swap_in.len() / 2,
            o.preempted,
            o.finished.len()
        )
    }

    /// Step number (1 for the first `schedule()`).
    #[getter]
    fn step(&self) -> u64 {
        self.out.step
    }

    /// S, the scheduled (computing) sequences.
    #[getter]
    fn num_seqs(&self) -> usize {
        self.out.num_seqs()
    }

    /// K, the samples to draw.
    #[getter]
    fn num_samples(&self) -> usize {
        self.out.num_samples()
    }

    /// T, the tokens computed this step.
    #[getter]
    fn num_batched_tokens(&self) -> usize {
        self.out.num_batched_tokens
    }

    /// Every scheduled sequence computes exactly one token (False for an empty step).
    #[getter]
    fn is_decode_only(&self) -> bool {
        self.out.is_decode_only()
    }

    /// int64 [S] sequence ids, batch order.
    #[getter]
    fn seq_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 0, |o, _| np_array(py, &o.seq_ids, "int64", None))
    }

    /// list[str] [S] owning request of each scheduled sequence.
    #[getter]
    fn request_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 1, |o, s| s.borrow(py).id_list(py, &o.handles, &o.gens))
    }

    /// int32 [S] index of each scheduled sequence within its request.
    #[getter]
    fn seq_index(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 2, |o, _| np_array(py, &o.seq_index, "int32", None))
    }

    /// int32 [S] tokens computed this step.
    #[getter]
    fn num_tokens(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 3, |o, _| np_array(py, &o.num_tokens, "int32", None))
    }

    /// int32 [S] position of the first of them (= tokens computed before).
    #[getter]
    fn start_pos(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 4, |o, _| np_array(py, &o.start_pos, "int32", None))
    }

    /// int32 [S] context length after this step (start_pos + num_tokens).
    #[getter]
    fn seq_lens(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 5, |o, _| np_array(py, &o.seq_lens(), "int32", None))
    }

    /// int32 [S+1] cumulative num_tokens.
    #[getter]
    fn query_start_loc(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 6, |o, _| {
            np_array(py, &o.query_start_loc(), "int32", None)
        })
    }

    /// int64 [T] token ids to compute, batch order.
    #[getter]
    fn input_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 7, |o, s| {
            s.borrow(py)
                .inner
                .with_input_ids(o, |ids| np_array(py, ids, "int64", None))
        })
    }

    /// int64 [T] their positions.
    #[getter]
    fn positions(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 8, |o, _| np_array(py, &o.positions(), "int64", None))
    }

    /// int64 [T] KV slot of each token (block * block_size + offset).
    #[getter]
    fn slot_mapping(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 9, |o, s| {
            np_array(py, &s.borrow(py).inner.slot_mapping(o), "int64", None)
        })
    }

    /// int32 [S, W] block tables padded with 0 to the widest of the step (block ids are
    /// below 2**31, so their u32 bytes read as int32). Built on first access, as they were
    /// at schedule time (the scheduler snapshots them before changing any of them).
    #[getter]
    fn block_tables(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 10, |o, s| {
            let (data, width) = s.borrow(py).inner.block_tables(o);
            np_array(py, &data, "int32", Some((o.num_seqs(), width)))
        })
    }

    /// int64 [K] batch row (0..S) whose last token's logits each sample uses.
    #[getter]
    fn sample_rows(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 11, |o, _| np_array(py, &o.sample_rows, "int64", None))
    }

    /// int64 [K] sequence receiving each sample (an n>1 fork repeats a row).
    #[getter]
    fn sample_seq_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 12, |o, _| {
            np_array(py, &o.sample_seq_ids, "int64", None)
        })
    }

    /// list[str] [K] request of each sample.
    #[getter]
    fn sample_request_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 13, |o, s| {
            s.borrow(py).id_list(py, &o.sample_handles, &o.sample_gens)
        })
    }

    /// int32 [K] index of the receiving sequence within its request (CompletionOutput.index).
    #[getter]
    fn sample_seq_index(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 14, |o, _| {
            np_array(py, &o.sample_seq_index, "int32", None)
        })
    }

    /// int64 [C, 2] (src, dst) device blocks to copy before the forward (copy-on-write).
    #[getter]
    fn blocks_to_copy(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 15, |o, _| {
            np_array(
                py,
                &o.blocks_to_copy,
                "int64",
                Some((o.blocks_to_copy.len() / 2, 2)),
            )
        })
    }

    /// int64 [O, 2] (device, host) blocks to swap out.
    #[getter]
    fn blocks_to_swap_out(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 16, |o, _| {
            np_array(
                py,
                &o.blocks_to_swap_out,
                "int64",
                Some((o.blocks_to_swap_out.len() / 2, 2)),
            )
        })
    }

    /// int64 [I, 2] (host, device) blocks to swap in.
    #[getter]
    fn blocks_to_swap_in(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 17, |o, _| {
            np_array(
                py,
                &o.blocks_to_swap_in,
                "int64",
                Some((o.blocks_to_swap_in.len() / 2, 2)),
            )
        })
    }

    /// list[str] request ids preempted this step, in preemption order.
    #[getter]
    fn preempted(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 18, |o, _| {
            Ok(PyList::new(py, &o.preempted)?.into_any().unbind())
        })
    }

    /// list[(request_id, reason)] finished at schedule time (ignored: can never be served).
    #[getter]
    fn finished(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 19, |o, _| {
            Ok(PyList::new(py, &o.finished)?.into_any().unbind())
        })
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedulerOutput>()?;
    Ok(())
}
