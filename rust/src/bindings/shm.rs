//! The shared-memory transports of `crate::dist` for the tensor-parallel executor: the ranks'
//! all-reduce and the step broadcast ring. Waits run with the GIL released. Failures map onto
//! Python's own exceptions: a bad argument `ValueError`, the OS refusing `OSError`, a peer too
//! slow `TimeoutError`, a peer dead or a group aborted `ConnectionError`.
use std::time::Duration;

use numpy::{PyArrayDescrMethods, PyReadwriteArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyConnectionError, PyOSError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::dist::ring_numpy::{item_arrays, item_of_array};
use crate::dist::shm_allreduce::{Bf16, ShmAllReduce};
use crate::dist::shm_ring::{DType, Reader, Writer};
use crate::dist::DistError;

fn to_py(err: DistError) -> PyErr {
    let msg = err.to_string();
    match err {
        DistError::InvalidArgument(_) => PyValueError::new_err(msg),
        DistError::Os(_) => PyOSError::new_err(msg),
        DistError::Timeout(_) => PyTimeoutError::new_err(msg),
        DistError::PeerDied { .. } | DistError::Aborted => PyConnectionError::new_err(msg),
    }
}

fn seconds(name: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    value
        .map(|s| {
            Duration::try_from_secs_f64(s)
                .map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {s}")))
        })
        .transpose()
}

/// One rank's end of the sum all-reduce over a shared segment (`crate::dist::shm_allreduce`).
#[pyclass(module = "pagedllm._core", name = "ShmAllReduce")]
struct PyShmAllReduce {
    inner: ShmAllReduce,
}

#[pymethods]
impl PyShmAllReduce {
    /// Rank 0: a new segment for `world_size` ranks, tensors moving in `chunk_bytes` pieces.
    #[staticmethod]
    fn create(world_size: usize, chunk_bytes: usize, timeout_s: f64) -> PyResult<Self> {
        let timeout = seconds("timeout_s", Some(timeout_s))?.expect("given");
        let inner = ShmAllReduce::create(world_size, chunk_bytes, timeout).map_err(to_py)?;
        Ok(PyShmAllReduce { inner })
    }

    /// Rank `rank` (>= 1): maps the segment `name` rank 0 created.
    #[staticmethod]
    fn attach(name: &str, rank: usize, timeout_s: f64) -> PyResult<Self> {
        let timeout = seconds("timeout_s", Some(timeout_s))?.expect("given");
        let inner = ShmAllReduce::attach(name, rank, timeout).map_err(to_py)?;
        Ok(PyShmAllReduce { inner })
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world()
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.inner.chunk_bytes()
    }

    /// Removes the segment's name from /dev/shm (the ranks keep their mappings). Idempotent.
    fn unlink(&self) -> PyResult<()> {
        self.inner.unlink().map_err(to_py)
    }

    /// Fails every rank's current and later all-reduces at once (this rank gave up).
    fn abort(&mut self) {
        self.inner.abort();
    }

    /// Sums the contiguous float32 `data` over the ranks, in place.
    fn all_reduce_f32(
        &mut self,
        py: Python<'_>,
        mut data: PyReadwriteArray1<'_, f32>,
    ) -> PyResult<()> {
        let data = data
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("data must be a contiguous 1-D array"))?;
        let inner = &mut self.inner;
        py.detach(|| inner.all_reduce(data)).map_err(to_py)
    }

    /// Sums the contiguous bfloat16 `data` (its bits, viewed as int16) over the ranks, in place.
    fn all_reduce_bf16(
        &mut self,
        py: Python<'_>,
        mut data: PyReadwriteArray1<'_, i16>,
    ) -> PyResult<()> {
        let data = data
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("data must be a contiguous 1-D array"))?;
        let data = Bf16::from_i16_bits_mut(data);
        let inner = &mut self.inner;
        py.detach(|| inner.all_reduce(data)).map_err(to_py)
    }
}

fn dtype_of(array: &Bound<'_, PyUntypedArray>) -> PyResult<DType> {
    let dtype = array.dtype();
    let found = match (dtype.kind(), dtype.itemsize()) {
        (b'b', 1) => Some(DType::Bool),
        (b'u', 1) => Some(DType::U8),
        (b'i', 2) => Some(DType::I16),
        (b'i', 4) => Some(DType::I32),
        (b'i', 8) => Some(DType::I64),
        (b'f', 4) => Some(DType::F32),
        (b'f', 8) => Some(DType::F64),
        _ => None,
    };
    found.ok_or_else(|| {
        PyValueError::new_err(format!(
            "arrays of dtype {} cannot travel through the ring (bool, uint8, int16/32/64, \
             float32/64 can)",
            dtype
        ))
    })
}

/// The writer's end of a broadcast ring (`crate::dist::shm_ring`): the engine's rank 0.
#[pyclass(module = "pagedllm._core", name = "ShmRingWriter")]
struct PyShmRingWriter {
    inner: Writer,
}

#[pymethods]
impl PyShmRingWriter {
    #[new]
    fn new(n_readers: usize, n_chunks: usize, chunk_bytes: usize) -> PyResult<Self> {
        let inner = Writer::create(n_readers, n_chunks, chunk_bytes).map_err(to_py)?;
        Ok(PyShmRingWriter { inner })
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn unlink(&self) -> PyResult<()> {
        self.inner.unlink().map_err(to_py)
    }

    /// Sends `tag`, `ints` and `arrays` (C-contiguous numpy arrays or None) to every reader,
    /// waiting at most `timeout_s` (None: for ever) for a free chunk. False: larger than a chunk,
    /// nothing sent.
    #[pyo3(signature = (tag, ints, arrays, timeout_s=None))]
    fn publish(
        &mut self,
        tag: u32,
        ints: Vec<i64>,
        arrays: Vec<Option<Bound<'_, PyUntypedArray>>>,
        timeout_s: Option<f64>,
    ) -> PyResult<bool> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let items = arrays
            .iter()
            .map(|array| {
                array
                    .as_ref()
                    .map(|a| item_of_array(a, dtype_of(a)?))
                    .transpose()
            })
            .collect::<PyResult<Vec<_>>>()?;
        self.inner
            .publish(tag, &ints, &items, timeout)
            .map_err(to_py)
    }
}

/// A reader's end of a broadcast ring: a worker.
#[pyclass(module = "pagedllm._core", name = "ShmRingReader")]
struct PyShmRingReader {
    inner: Reader,
}

#[pymethods]
impl PyShmRingReader {
    /// The reader of rank `rank` (1..=n_readers) of the ring `name`.
    #[new]
    fn new(name: &str, rank: usize) -> PyResult<Self> {
        let inner = Reader::attach(name, rank).map_err(to_py)?;
        Ok(PyShmRingReader { inner })
    }

    /// The next message as (tag, ints, arrays), waiting at most `timeout_s` (None: for ever;
    /// None is returned when it passes). The arrays are views of the ring, valid until `ack()`
    /// (or the next `receive`): use them, then acknowledge. A dead writer: ConnectionError.
    #[pyo3(signature = (timeout_s=None))]
    #[allow(clippy::type_complexity)]
    fn receive<'py>(
        &mut self,
        py: Python<'py>,
        timeout_s: Option<f64>,
    ) -> PyResult<Option<(u32, Vec<i64>, Bound<'py, PyList>)>> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let inner = &mut self.inner;
        let Some(message) = py.detach(|| inner.receive(timeout)).map_err(to_py)? else {
            return Ok(None);
        };
        let arrays = item_arrays(py, &self.inner, &message)?;
        Ok(Some((message.tag, message.ints, PyList::new(py, arrays)?)))
    }

    /// Done with the last message: the writer may reuse its chunk.
    fn ack(&mut self) {
        self.inner.ack();
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyShmAllReduce>()?;
    m.add_class::<PyShmRingWriter>()?;
    m.add_class::<PyShmRingReader>()?;
    Ok(())
}
