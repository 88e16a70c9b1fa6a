//! Range checks of the memory manager's Python arguments (Python ints arrive as `i64`): a bad
//! value raises `ValueError` with our message before anything changes.
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::ids::{BlockId, SeqId, TokenId};

pub(crate) fn seq_id(value: i64) -> PyResult<SeqId> {
    SeqId::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("sequence id must be >= 0, got {value}")))
}

pub(crate) fn seq_ids(values: Vec<i64>) -> PyResult<Vec<SeqId>> {
    values.into_iter().map(seq_id).collect()
}

pub(crate) fn token_ids(values: Vec<i64>) -> PyResult<Vec<TokenId>> {
    values
        .into_iter()
        .map(|t| {
            TokenId::try_from(t)
                .map_err(|_| PyValueError::new_err(format!("token id {t} is out of range")))
        })
        .collect()
}

pub(crate) fn block_id(value: i64) -> PyResult<BlockId> {
    BlockId::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("block id {value} is out of range")))
}
