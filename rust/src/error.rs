//! The crate's error type. The bindings map it to Python exceptions
//! (`ValueError` for bad arguments, `PagedLLMError` for the rest).
use std::fmt;

use crate::ids::{BlockId, SeqId};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// An argument is out of range or inconsistent (block_size 0, watermark outside [0, 1), ...).
    InvalidArgument(String),
    /// No sequence with this id is known to the manager (also: a second `free`).
    UnknownSequence(SeqId),
    /// A sequence with this id already exists.
    DuplicateSequence(SeqId),
    /// The device pool has fewer free blocks than the operation needs.
    OutOfDeviceBlocks { needed: usize, free: usize },
    /// The host (swap) pool has fewer free blocks than the operation needs.
    OutOfHostBlocks { needed: usize, free: usize },
    /// The operation does not apply to the object's current state
    /// (e.g. appending to a swapped-out sequence).
    InvalidState(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
            Error::UnknownSequence(id) => write!(f, "unknown sequence id {id}"),
            Error::DuplicateSequence(id) => write!(f, "sequence id {id} already exists"),
            Error::OutOfDeviceBlocks { needed, free } => {
                write!(f, "out of device blocks: {needed} needed, {free} free")
            }
            Error::OutOfHostBlocks { needed, free } => {
                write!(f, "out of host (swap) blocks: {needed} needed, {free} free")
            }
            Error::InvalidState(msg) => write!(f, "invalid state: {msg}"),
        }
    }
}

impl std::error::Error for Error {}

/// Message for an internal consistency failure on one block (used by invariant checks).
pub(crate) fn block_violation(pool: &str, block: BlockId, what: &str) -> String {
    format!("{pool} block {block}: {what}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_bad_value() {
        assert_eq!(
            Error::UnknownSequence(7).to_string(),
            "unknown sequence id 7"
        );
        assert_eq!(
            Error::DuplicateSequence(3).to_string(),
            "sequence id 3 already exists"
        );
        assert!(Error::OutOfHostBlocks { needed: 4, free: 1 }
            .to_string()
            .contains("4 needed, 1 free"));
        assert!(Error::InvalidArgument("block_size must be > 0".into())
            .to_string()
            .contains("block_size"));
    }
}
