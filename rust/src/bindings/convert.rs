//! Python values into the core's types: integer arguments checked against their Rust type
//! (a `ValueError` naming the request and field, never pyo3's bare `OverflowError` or a
//! truncated float), token-id lists and arrays read strictly as integers, and the clock of
//! default arrival times.
use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::scheduler::request_repr;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

pub(crate) fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    NUMPY
        .get_or_try_init(py, || Ok(py.import("numpy")?.unbind()))
        .map(|m| m.bind(py))
}

/// Seconds on the `time.time()` clock (the clock of default arrival times).
pub(crate) fn wall_clock() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
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

/// An integer argument within `[lo, hi]`: a `ValueError` starting `prefix` (the request, if
/// any) and naming the field and the bound otherwise, never pyo3's bare `OverflowError` or a
/// truncated float. Above `hi` the message is `over(value as given)` when given, else the
/// bound followed by `limit` (where `hi` comes from, if anywhere).
fn int_arg(
    obj: &Bound<'_, PyAny>,
    prefix: &str,
    name: &str,
    (lo, hi): (i128, i128),
    limit: &str,
    over: Option<&dyn Fn(&str) -> String>,
) -> PyResult<i128> {
    let bad = |m: String| PyValueError::new_err(format!("{prefix}{name} {m}"));
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
        _ => match over {
            Some(over) => Err(PyValueError::new_err(format!(
                "{prefix}{}",
                over(&obj.repr()?.to_string())
            ))),
            None => Err(bad(format!("must be <= {hi}{limit}, got {}", obj.repr()?))),
        },
    }
}

/// Range of the integer arguments held as `usize` / `i64` on the Rust side (one limit for
/// all, so every count fits either).
pub(crate) const I64_RANGE: (i128, i128) = (i64::MIN as i128, i64::MAX as i128);

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
    /// The value of a request's argument (errors name the request `id`).
    pub(crate) fn get(
        &self,
        id: &str,
        name: &str,
        range: (i128, i128),
        limit: &str,
    ) -> PyResult<i128> {
        self.checked(
            &format!("request {}: ", request_repr(id)),
            name,
            range,
            limit,
            None,
        )
    }

    /// `get` with the message above the range written by `over` (from the value as given).
    pub(crate) fn get_or(
        &self,
        id: &str,
        name: &str,
        range: (i128, i128),
        over: &dyn Fn(&str) -> String,
    ) -> PyResult<i128> {
        self.checked(
            &format!("request {}: ", request_repr(id)),
            name,
            range,
            "",
            Some(over),
        )
    }

    /// The value of a configuration knob (errors name the knob only).
    pub(crate) fn knob(&self, name: &str, range: (i128, i128)) -> PyResult<i128> {
        self.checked("", name, range, "", None)
    }

    fn checked(
        &self,
        prefix: &str,
        name: &str,
        range: (i128, i128),
        limit: &str,
        over: Option<&dyn Fn(&str) -> String>,
    ) -> PyResult<i128> {
        match self {
            IntArg::Given(obj) => int_arg(obj, prefix, name, range, limit, over),
            IntArg::Default(v) => Ok(*v),
        }
    }
}

/// A number of seconds (an int or a float; not a bool): a `ValueError` starting `prefix` and
/// naming `name` for anything else. Whether it is finite is the core's rule.
pub(crate) fn seconds(obj: &Bound<'_, PyAny>, prefix: &str, name: &str) -> PyResult<f64> {
    if is_integer(obj)? || obj.is_instance_of::<PyFloat>() {
        if let Ok(v) = obj.extract::<f64>() {
            return Ok(v);
        }
    }
    Err(PyValueError::new_err(format!(
        "{prefix}{name} must be None or a number of seconds, got {} {}",
        obj.get_type().name()?,
        obj.repr()?
    )))
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
pub(crate) fn read_i64(obj: &Bound<'_, PyAny>, what: &str, into: &mut Vec<i64>) -> PyResult<()> {
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
            "{what} must be a list of ints or an integer numpy array, got {} {:.80}",
            obj.get_type().name()?,
            obj.repr()?.to_string()
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
    let dtype = arr.getattr("dtype")?;
    let kind: String = dtype.getattr("kind")?.extract()?;
    let empty = arr.getattr("size")?.extract::<usize>()? == 0;
    if ndim != 1 || (!empty && kind != "i" && kind != "u") {
        // the array's own dtype (a torch tensor's is `torch.float32`, say)
        let shown = obj.getattr("dtype").unwrap_or(dtype);
        return Err(PyValueError::new_err(format!(
            "{what} must be a 1-D integer array, got a {ndim}-D {} {}",
            shown.str()?,
            obj.get_type().name()?
        )));
    }
    if empty {
        return Ok(());
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

pub(crate) fn read_flags(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<bool>> {
    let py = obj.py();
    let arr = numpy(py)?
        .call_method1("asarray", (obj, "uint8"))
        .map_err(|e| PyValueError::new_err(format!("{what} must be booleans: {e}")))?;
    let buf = PyBuffer::<u8>::get(&arr.call_method0("ravel")?)?;
    let mut v = vec![0u8; buf.item_count()];
    buf.copy_to_slice(py, &mut v)?;
    Ok(v.into_iter().map(|b| b != 0).collect())
}
