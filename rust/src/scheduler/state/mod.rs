//! The scheduler's state between steps: the requests (`request.rs`) in their slab
//! (`store.rs`), the queues that order them (`queue.rs`), and the ledger of the latest step
//! (`step.rs`). The phases (`schedule/`, `apply/`) change it only through these types'
//! methods and fields; nothing here decides anything about a step.
pub(super) mod queue;
pub(super) mod request;
pub(super) mod step;
pub(super) mod store;
