//! The queues: `waiting`, `running`, `swapped`, the seats `running` takes, the requests found
//! unservable at `add_request`, and this step's preempted requests until they are requeued.
//!
//! Order: `fcfs` keeps insertion order (preempted requests go back to the head), `priority`
//! keeps `waiting` and `swapped` sorted by (priority, arrival) and sorts `running` at the start
//! of each step so its tail is always the lowest-ranked request. Who joins or leaves
//! `running`, and every seat freed, goes through a method here, so `running_seats` always adds
//! up (the strategies only reorder `running`).
use std::collections::VecDeque;

use super::request::{rank_less, RequestStatus};
use super::store::RequestStore;
use crate::scheduler::Policy;

/// The two queues requests are admitted from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::scheduler) enum Queue {
    Waiting,
    Swapped,
}

#[derive(Debug)]
pub(in crate::scheduler) struct Queues {
    policy: Policy,
    pub(in crate::scheduler) waiting: VecDeque<u32>,
    pub(in crate::scheduler) running: Vec<u32>,
    pub(in crate::scheduler) swapped: VecDeque<u32>,
    /// Seats (`max_num_seqs`) taken by `running`: its unfinished sequences.
    pub(in crate::scheduler) running_seats: usize,
    /// Requests found unservable at `add_request`, reported by the next `schedule()`.
    pub(in crate::scheduler) pending_ignored: Vec<(u32, String)>,
    /// This step's preempted requests, in preemption order, until `requeue_preempted`.
    pub(in crate::scheduler) preempted_recompute: Vec<u32>,
    pub(in crate::scheduler) preempted_swap: Vec<u32>,
}

impl Queues {
    pub(in crate::scheduler) fn new(policy: Policy) -> Self {
        Queues {
            policy,
            waiting: VecDeque::new(),
            running: Vec::new(),
            swapped: VecDeque::new(),
            running_seats: 0,
            pending_ignored: Vec::new(),
            preempted_recompute: Vec::new(),
            preempted_swap: Vec::new(),
        }
    }

    /// Position that keeps `queue` sorted by rank, after requests of equal rank.
    fn rank_position(store: &RequestStore, queue: &VecDeque<u32>, h: u32) -> usize {
        let r = store.get(h).rank();
        queue.partition_point(|&x| !rank_less(r, store.get(x).rank()))
    }

    /// Queues `h` at its place: the tail under `fcfs` (or the head when `at_head`), its rank
    /// under `priority`.
    fn insert(
        policy: Policy,
        store: &RequestStore,
        queue: &mut VecDeque<u32>,
        h: u32,
        at_head: bool,
    ) {
        match policy {
            Policy::Fcfs if at_head => queue.push_front(h),
            Policy::Fcfs => queue.push_back(h),
            Policy::Priority => {
                let at = Self::rank_position(store, queue, h);
                queue.insert(at, h);
            }
        }
    }

    pub(in crate::scheduler) fn enqueue_waiting(&mut self, h: u32, store: &RequestStore) {
        Self::insert(self.policy, store, &mut self.waiting, h, false);
    }

    /// Queues this step's preempted requests: recompute ones at the head of `waiting`,
    /// swapped ones at the tail of `swapped`, in both cases earlier-ranked first.
    pub(in crate::scheduler) fn requeue_preempted(&mut self, store: &RequestStore) {
        // Victims are taken from the tail of `running`, so the preemption order is the
        // reverse of the rank order.
        for &h in &self.preempted_recompute {
            Self::insert(self.policy, store, &mut self.waiting, h, true);
        }
        self.preempted_recompute.clear();
        for &h in self.preempted_swap.iter().rev() {
            Self::insert(self.policy, store, &mut self.swapped, h, false);
        }
        self.preempted_swap.clear();
    }

    /// Under `priority`: best-ranked first, so victims (the tail) are the lowest-ranked.
    pub(in crate::scheduler) fn sort_running_by_rank(&mut self, store: &RequestStore) {
        if self.policy != Policy::Priority || self.running.len() < 2 {
            return;
        }
        self.running.sort_by(|&a, &b| {
            let (ra, rb) = (store.get(a).rank(), store.get(b).rank());
            if rank_less(ra, rb) {
                std::cmp::Ordering::Less
            } else if rank_less(rb, ra) {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        });
    }

    /// The swapped-queue guard: whether a waiting request may be admitted while requests are
    /// swapped out. Never under `fcfs` (swapped groups come back first), only when it
    /// outranks the best swapped group under `priority`.
    pub(in crate::scheduler) fn admission_open_for(&self, h: u32, store: &RequestStore) -> bool {
        match self.swapped.front() {
            None => true,
            Some(&s) => {
                self.policy == Policy::Priority
                    && rank_less(store.get(h).rank(), store.get(s).rank())
            }
        }
    }

    fn queue(&self, q: Queue) -> &VecDeque<u32> {
        match q {
            Queue::Waiting => &self.waiting,
            Queue::Swapped => &self.swapped,
        }
    }

    fn queue_mut(&mut self, q: Queue) -> &mut VecDeque<u32> {
        match q {
            Queue::Waiting => &mut self.waiting,
            Queue::Swapped => &mut self.swapped,
        }
    }

    /// The request at position `at` of queue `q`.
    pub(in crate::scheduler) fn get(&self, q: Queue, at: usize) -> Option<u32> {
        self.queue(q).get(at).copied()
    }

    /// Takes the request at position `at` out of queue `q`.
    pub(in crate::scheduler) fn remove_at(&mut self, q: Queue, at: usize) -> u32 {
        self.queue_mut(q)
            .remove(at)
            .expect("position is in the queue")
    }

    /// Takes `h` out of queue `q`, wherever it is.
    pub(in crate::scheduler) fn remove(&mut self, q: Queue, h: u32) {
        let at = self.queue(q).iter().position(|&x| x == h);
        self.remove_at(q, at.expect("request is queued"));
    }

    /// Moves the request at position `at` of queue `q` (just admitted or swapped in) to the
    /// tail of `running`.
    pub(in crate::scheduler) fn start_running(
        &mut self,
        q: Queue,
        at: usize,
        store: &mut RequestStore,
    ) {
        let h = self.remove_at(q, at);
        let req = store.get_mut(h);
        req.status = RequestStatus::Running;
        self.running_seats += req.seats();
        self.running.push(h);
    }

    /// Takes the tail of `running` (the lowest-ranked request) out, giving back its seats.
    pub(in crate::scheduler) fn pop_running(&mut self, store: &RequestStore) -> Option<u32> {
        let h = self.running.pop()?;
        self.running_seats -= store.get(h).seats();
        Some(h)
    }

    /// Takes `h` out of `running`, giving back its seats.
    pub(in crate::scheduler) fn remove_running(&mut self, h: u32, store: &RequestStore) {
        let at = self.running.iter().position(|&x| x == h);
        self.running.remove(at.expect("running request is queued"));
        self.running_seats -= store.get(h).seats();
    }

    /// A running sequence finished: its seat is free.
    #[inline]
    pub(in crate::scheduler) fn seat_freed(&mut self) {
        self.running_seats -= 1;
    }

    /// Takes the requests that finished in `update_from_output` (their seats were given back
    /// sequence by sequence) out of `running`, into `done`.
    pub(in crate::scheduler) fn take_finished(
        &mut self,
        store: &RequestStore,
        done: &mut Vec<u32>,
    ) {
        self.running.retain(|&h| {
            let keep = store.try_get(h).is_some_and(|r| !r.status.is_finished());
            if !keep {
                done.push(h);
            }
            keep
        });
    }

    /// Takes `h` (a live, unfinished or ignored request) out of whichever queue its status
    /// puts it in. Returns false for statuses no queue holds.
    pub(in crate::scheduler) fn remove_request(&mut self, h: u32, store: &RequestStore) -> bool {
        match store.get(h).status {
            RequestStatus::Waiting
            | RequestStatus::WaitingForRemoteKvs
            | RequestStatus::Preempted => self.remove(Queue::Waiting, h),
            RequestStatus::Running => self.remove_running(h, store),
            RequestStatus::Swapped => self.remove(Queue::Swapped, h),
            RequestStatus::FinishedIgnored => self.pending_ignored.retain(|(x, _)| *x != h),
            _ => return false,
        }
        true
    }

    /// Ids of a queue's requests, in order.
    pub(in crate::scheduler) fn ids<'a>(
        handles: impl IntoIterator<Item = &'a u32>,
        store: &'a RequestStore,
    ) -> Vec<&'a str> {
        handles
            .into_iter()
            .map(|&h| store.get(h).id.as_str())
            .collect()
    }
}
