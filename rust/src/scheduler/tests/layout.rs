//! Memory layout the decode step relies on.
use super::*;

#[test]
fn slot_generation_and_hot_request_fields_share_a_line() {
    use std::mem::{align_of, offset_of, size_of};
    assert_eq!(align_of::<Slot>(), 64);
    assert_eq!(offset_of!(Slot, gen), 0);
    // Option<Request> takes no tag (niche), so the request starts right after the generation;
    // the niche is the 8-byte status (the largest one, see `RequestStatus`), in this line.
    assert_eq!(size_of::<Option<Request>>(), size_of::<Request>());
    assert_eq!(size_of::<RequestStatus>(), 8);
    assert_eq!(offset_of!(Request, status), 0);
    assert_eq!(offset_of!(Slot, req), 8);
}
