//! The request store: a slab of request slots addressed by `u32` handles (no hashing after
//! `add_request`), each with a generation so that outputs naming (slot, generation) still
//! resolve, or fail to, after the request left; the id -> slot map; and the counters that
//! hand out sequence ids and insertion order.
use std::collections::{HashMap, VecDeque};

use crate::ids::SeqId;

use super::request::Request;

/// Freed request slots are reused only once this many wait in line, so the ids of a recent
/// step's output stay resolvable (outputs name requests by slot + generation).
const RECYCLE_AFTER: usize = 4096;

/// `repr(C)`, cache-line aligned: the generation and the request's hot fields (see
/// [`Request`]) share the slot's first line.
#[derive(Debug)]
#[repr(C, align(64))]
pub(in crate::scheduler) struct Slot {
    pub(in crate::scheduler) gen: u32,
    pub(in crate::scheduler) req: Option<Request>,
    /// Id of the current (or last) occupant; kept after it leaves so old outputs resolve it.
    pub(in crate::scheduler) id: String,
}

#[derive(Debug, Default)]
pub(in crate::scheduler) struct RequestStore {
    slots: Vec<Slot>,
    free_slots: VecDeque<u32>,
    by_id: HashMap<String, u32>,
    next_seq_id: SeqId,
    next_order: u64,
}

impl RequestStore {
    /// Ids for a new request of `n` sequences: its first sequence id and its insertion order.
    pub(in crate::scheduler) fn next_ids(&mut self, n: usize) -> (SeqId, u64) {
        let ids = (self.next_seq_id, self.next_order);
        self.next_seq_id += n as SeqId;
        self.next_order += 1;
        ids
    }

    /// Stores a new request (its id must not be live); returns its slot.
    pub(in crate::scheduler) fn place(&mut self, req: Request) -> u32 {
        let h = if self.free_slots.len() > RECYCLE_AFTER {
            let h = self.free_slots.pop_front().expect("non-empty");
            let slot = &mut self.slots[h as usize];
            slot.gen = slot.gen.wrapping_add(1);
            slot.id.clone_from(&req.id);
            slot.req = Some(req);
            h
        } else {
            let h = u32::try_from(self.slots.len()).expect("fewer than 2^32 request slots");
            self.slots.push(Slot {
                id: req.id.clone(),
                req: Some(req),
                gen: 0,
            });
            h
        };
        self.by_id.insert(self.slots[h as usize].id.clone(), h);
        h
    }

    /// Takes a request out of the store; its slot waits to be reused (see `RECYCLE_AFTER`).
    pub(in crate::scheduler) fn take(&mut self, h: u32) -> Request {
        let req = self.slots[h as usize]
            .req
            .take()
            .expect("released slot holds a request");
        self.by_id.remove(&req.id);
        self.free_slots.push_back(h);
        req
    }

    /// The request in slot `h`, which must hold one (every queued handle does).
    #[inline]
    pub(in crate::scheduler) fn get(&self, h: u32) -> &Request {
        self.slots[h as usize]
            .req
            .as_ref()
            .expect("queued slot holds a request")
    }

    #[inline]
    pub(in crate::scheduler) fn get_mut(&mut self, h: u32) -> &mut Request {
        self.slots[h as usize]
            .req
            .as_mut()
            .expect("queued slot holds a request")
    }

    /// The request in slot `h`, if the slot holds one.
    #[inline]
    pub(in crate::scheduler) fn try_get(&self, h: u32) -> Option<&Request> {
        self.slots[h as usize].req.as_ref()
    }

    #[inline]
    pub(in crate::scheduler) fn try_get_mut(&mut self, h: u32) -> Option<&mut Request> {
        self.slots[h as usize].req.as_mut()
    }

    pub(in crate::scheduler) fn is_live(&self, h: u32, gen: u32) -> bool {
        let slot = &self.slots[h as usize];
        slot.gen == gen && slot.req.is_some()
    }

    /// Every slot, for a walk that reads many (see `schedule::decode::fast_decode_run`).
    #[inline]
    pub(in crate::scheduler) fn slots_mut(&mut self) -> &mut [Slot] {
        &mut self.slots
    }

    /// Generation of a request slot (bumped each time the slot is reused).
    #[inline]
    pub(in crate::scheduler) fn gen(&self, h: u32) -> u32 {
        self.slots[h as usize].gen
    }

    /// Id of the request an output named by (slot, generation); `None` once the slot has
    /// been given to another request.
    pub(in crate::scheduler) fn resolve(&self, h: u32, gen: u32) -> Option<&str> {
        let slot = self.slots.get(h as usize)?;
        (slot.gen == gen).then_some(slot.id.as_str())
    }

    pub(in crate::scheduler) fn handle_of(&self, request_id: &str) -> Option<u32> {
        self.by_id.get(request_id).copied()
    }

    /// Number of live requests, counted by id.
    pub(in crate::scheduler) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(in crate::scheduler) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Number of slots holding a request (equals `len` when consistent).
    pub(in crate::scheduler) fn num_occupied(&self) -> usize {
        self.slots.iter().filter(|s| s.req.is_some()).count()
    }
}
