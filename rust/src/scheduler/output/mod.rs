//! What a step hands out: the `StepOutput` type and its parts (`step_output.rs`), and the
//! recorder that fills it (`record.rs`: rows of the general path, buffers reused across
//! steps, the lazy per-token arrays and block tables, and their snapshots).
pub(super) mod record;
mod step_output;

pub use step_output::{FinishedSeq, LazyTables, SharedTables, StepExtras, StepOutput, TableRow};
