//! Statistics: counters beyond the queue lengths, and the `get_stats()` snapshot.
use crate::connector::OffloadStats;
use crate::kv::CacheStats;

use super::Scheduler;

/// Counters beyond the queue lengths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    pub num_steps: u64,
    pub num_preemptions_recompute: u64,
    pub num_preemptions_swap: u64,
    pub num_finished: u64,
    pub num_ignored: u64,
    pub num_aborted: u64,
    pub num_batched_tokens_total: u64,
    /// Steps taken back by `discard_step`.
    pub num_rolled_back_steps: u64,
}

/// Snapshot for `get_stats()`.
#[derive(Debug, Clone)]
pub struct SchedulerStats {
    pub num_waiting: usize,
    pub num_running: usize,
    pub num_swapped: usize,
    pub num_running_seqs: usize,
    pub counters: SchedulerCounters,
    pub cache: CacheStats,
    /// The KV connector's tier, when one is attached and keeps counters.
    pub offload: Option<OffloadStats>,
    pub num_waiting_for_remote_kvs: usize,
}

impl Scheduler {
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_waiting: self.queues.waiting.len(),
            num_running: self.queues.running.len(),
            num_swapped: self.queues.swapped.len(),
            num_running_seqs: self.queues.running_seats,
            counters: self.counters,
            cache: self.mgr.stats(),
            offload: self.kv_connector().and_then(|c| c.offload_stats()),
            num_waiting_for_remote_kvs: self.num_waiting_for_remote_kvs(),
        }
    }
}
