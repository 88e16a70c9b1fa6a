//! The id types every layer shares (a leaf module: it imports nothing from the crate).

/// Sequence id (one per running sample; a request with n > 1 has n of them).
pub type SeqId = u64;
/// Physical block id within one pool (device and host ids are independent).
pub type BlockId = u32;
/// Token id.
pub type TokenId = u32;
