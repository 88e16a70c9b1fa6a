//! The Python exception type and the mapping of core errors onto Python exceptions.
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use crate::error::Error;

create_exception!(
    _core,
    PagedLLMError,
    PyException,
    "Error raised by the pagedllm core (out of blocks, invalid state, broken invariant)."
);

/// Bad arguments become `ValueError` (an `InvalidArgument`'s message as is: the type already
/// says it is one); capacity and state errors `PagedLLMError`.
impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        match err {
            Error::InvalidArgument(msg) => PyValueError::new_err(msg),
            Error::UnknownSequence(_) | Error::DuplicateSequence(_) => {
                PyValueError::new_err(err.to_string())
            }
            Error::OutOfDeviceBlocks { .. }
            | Error::OutOfHostBlocks { .. }
            | Error::InvalidState(_) => PagedLLMError::new_err(err.to_string()),
        }
    }
}

/// Converts a Python integer argument that must be >= 0, with a message naming the parameter
/// (taking `i64` keeps the error a `ValueError` of ours instead of pyo3's `OverflowError`).
pub(crate) fn non_negative(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {value}")))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PagedLLMError", m.py().get_type::<PagedLLMError>())
}
