//! The features beyond the core, each in one place: LoRA (`lora.rs`: a step holds at most
//! `max_loras` adapters, each row's adapter), structured output (`grammar.rs`: admission
//! waits for a request's grammar, the step's constrained samples) and speculative decoding
//! (`spec/`: the drafts, their fast path and their columns in the output), and a KV
//! connector (`connector.rs`: requests waiting for remote KV, blocks held while saved).
//!
//! A feature reaches the step through the seams the core leaves for it: its request state in
//! `RequestExtras`, its admission condition in `schedule::admission::conditions`, its per-row
//! data in `StepExtras`. The decode fast path (`schedule/decode.rs`) takes only the parts it
//! touches (the store's slots, the manager, its batch), so no feature reaches it unseen.
pub(super) mod connector;
mod grammar;
pub(super) mod lora;
pub(super) mod spec;
