//! Applying a step once it was computed, or taking it back when it was not: the sampled
//! tokens appended (`update.rs`, one per sample; `spec_update.rs`, a run per sample of a
//! verification step) under the stop rules (`stop.rs`), what finished freed; or the whole
//! step rolled back (`rollback.rs`, `discard_step`).
mod beams;
mod rollback;
mod spec_update;
pub(super) mod stop;
mod update;
