//! Queue order: `fcfs` keeps insertion order (preempted requests go back to the head),
//! `priority` keeps `waiting` and `swapped` sorted by (priority, arrival) and sorts
//! `running` at the start of each step so its tail is always the lowest-ranked request.
use std::collections::VecDeque;

use super::request::rank_less;
use super::{Policy, RequestStatus, Scheduler};

impl Scheduler {
    /// Position that keeps `queue` sorted by rank, after requests of equal rank.
    fn rank_position(&self, queue: &VecDeque<u32>, h: u32) -> usize {
        let r = self.req(h).rank();
        queue.partition_point(|&x| !rank_less(r, self.req(x).rank()))
    }

    pub(super) fn enqueue_waiting(&mut self, h: u32) {
        match self.cfg.policy {
            Policy::Fcfs => self.waiting.push_back(h),
            Policy::Priority => {
                let at = self.rank_position(&self.waiting, h);
                self.waiting.insert(at, h);
            }
        }
    }

    /// Queues this step's preempted requests: recompute ones at the head of `waiting`,
    /// swapped ones at the tail of `swapped`, in both cases earlier-ranked first.
    pub(super) fn requeue_preempted(&mut self) {
        // Victims are taken from the tail of `running`, so the preemption order is the
        // reverse of the rank order.
        let recompute = std::mem::take(&mut self.preempted_recompute);
        for &h in &recompute {
            match self.cfg.policy {
                Policy::Fcfs => self.waiting.push_front(h),
                Policy::Priority => {
                    let at = self.rank_position(&self.waiting, h);
                    self.waiting.insert(at, h);
                }
            }
        }
        self.preempted_recompute = recompute;
        self.preempted_recompute.clear();
        let swapped = std::mem::take(&mut self.preempted_swap);
        for &h in swapped.iter().rev() {
            match self.cfg.policy {
                Policy::Fcfs => self.swapped.push_back(h),
                Policy::Priority => {
                    let at = self.rank_position(&self.swapped, h);
                    self.swapped.insert(at, h);
                }
            }
        }
        self.preempted_swap = swapped;
        self.preempted_swap.clear();
    }

    /// Under `priority`: best-ranked first, so victims (the tail) are the lowest-ranked.
    pub(super) fn sort_running_by_rank(&mut self) {
        if self.cfg.policy != Policy::Priority || self.running.len() < 2 {
            return;
        }
        let mut running = std::mem::take(&mut self.running);
        running.sort_by(|&a, &b| {
            let (ra, rb) = (self.req(a).rank(), self.req(b).rank());
            if rank_less(ra, rb) {
                std::cmp::Ordering::Less
            } else if rank_less(rb, ra) {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        });
        self.running = running;
    }

    /// Whether a waiting request may be admitted while requests are swapped out: never
    /// under `fcfs` (swapped groups come back first), only when it outranks the best
    /// swapped group under `priority`.
    pub(super) fn admission_open_for(&self, h: u32) -> bool {
        match self.swapped.front() {
            None => true,
            Some(&s) => {
                self.cfg.policy == Policy::Priority
                    && rank_less(self.req(h).rank(), self.req(s).rank())
            }
        }
    }

    /// Moves the head of `waiting` (just admitted) to `running`.
    pub(super) fn admit_head(&mut self, h: u32) {
        let head = self.waiting.pop_front();
        debug_assert_eq!(head, Some(h));
        let seats = {
            let req = self.req_mut(h);
            req.status = RequestStatus::Running;
            req.seats()
        };
        self.running_seats += seats;
    }
}
