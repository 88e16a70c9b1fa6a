//! Shared-memory transports for tensor-parallel ranks on one host, independent of the rest.
//!
//! - [`segment`]: a POSIX shared-memory segment (`shm_open` + `mmap`), created by one process,
//!   opened by the others by name, unlinked as soon as every party has it mapped (so nothing is
//!   left under `/dev/shm`, even after a crash);
//! - [`wait`]: the waiting every transport shares: spin, then yield, then sleep on a futex in the
//!   segment, checking the peers' liveness (pidfds), an abort flag and a timeout;
//! - [`shm_allreduce`]: the ranks' sum all-reduce over one segment (float32, bfloat16);
//! - [`shm_ring`]: a broadcast ring of fixed-size chunks, one writer and N readers, carrying a
//!   tagged message of integers and arrays per chunk (the engine's step to its workers);
//! - `ring_numpy` (with the `python` feature): a received message's arrays as numpy arrays
//!   over the ring's memory, kept mapped while they live.
#[cfg(feature = "python")]
pub mod ring_numpy;
pub mod segment;
pub mod shm_allreduce;
pub mod shm_ring;
pub mod wait;

use std::fmt;

/// Why a shared-memory operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DistError {
    /// An argument is out of range (a rank past the world size, an oversized array, ...).
    InvalidArgument(String),
    /// The operating system refused (shm_open, ftruncate, mmap): what was attempted and why.
    Os(String),
    /// A peer did not arrive within the timeout.
    Timeout(String),
    /// A peer's process exited while this one waited for it.
    PeerDied { rank: usize, pid: u32 },
    /// A peer gave up on the group (its own wait failed); the group cannot go on.
    Aborted,
}

pub type DistResult<T> = std::result::Result<T, DistError>;

impl fmt::Display for DistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DistError::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
            DistError::Os(msg) => write!(f, "{msg}"),
            DistError::Timeout(msg) => write!(f, "timed out: {msg}"),
            DistError::PeerDied { rank, pid } => write!(f, "rank {rank} (pid {pid}) died"),
            DistError::Aborted => write!(f, "a peer aborted the shared-memory group"),
        }
    }
}

impl std::error::Error for DistError {}

/// `errno` of the last failed libc call, as text, after `what`.
pub(crate) fn os_error(what: &str) -> DistError {
    DistError::Os(format!("{what}: {}", std::io::Error::last_os_error()))
}
