//! The scheduler's consistency check (the manager checks its own first).
use std::collections::HashMap;

use super::state::request::{GrammarState, RequestStatus};
use super::Scheduler;

impl Scheduler {
    /// The manager's invariants plus the scheduler's own: every live request sits in exactly
    /// one place matching its status; seats add up; mirrored tables equal the manager's;
    /// waiting requests hold no blocks, swapped ones only host blocks; the running requests'
    /// adapters fit `max_loras`.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.mgr.check_invariants()?;
        let queues = &self.queues;
        let mut place: HashMap<u32, &str> = HashMap::new();
        let mut mark = |h: u32, q: &'static str| -> std::result::Result<(), String> {
            match place.insert(h, q) {
                None => Ok(()),
                Some(prev) => Err(format!("request slot {h} is in both {prev} and {q}")),
            }
        };
        for &h in &queues.waiting {
            mark(h, "waiting")?;
        }
        for &h in &queues.running {
            mark(h, "running")?;
        }
        for &h in &queues.swapped {
            mark(h, "swapped")?;
        }
        for &(h, _) in &queues.pending_ignored {
            mark(h, "ignored")?;
        }
        let live = self.store.num_occupied();
        if live != place.len() || live != self.store.len() {
            return Err(format!(
                "{live} live requests, {} queued, {} ids",
                place.len(),
                self.store.len()
            ));
        }
        let mut seats = 0;
        let mut held_by_requests = 0;
        for (&h, &q) in &place {
            let Some(req) = self.store.try_get(h) else {
                return Err(format!("queue {q} names empty slot {h}"));
            };
            let ok = match q {
                "waiting" => req.status.is_waiting(),
                "running" => req.status == RequestStatus::Running,
                "swapped" => req.status == RequestStatus::Swapped,
                _ => req.status == RequestStatus::FinishedIgnored,
            };
            if !ok {
                return Err(format!(
                    "request {} in {q} has status {:?}",
                    req.id, req.status
                ));
            }
            if req.extras.grammar == GrammarState::Compiling && q != "waiting" && q != "ignored" {
                return Err(format!(
                    "request {} is in {q} while its grammar compiles",
                    req.id
                ));
            }
            if req.num_unfinished != req.seqs.iter().filter(|s| !s.is_finished()).count() {
                return Err(format!("request {}: unfinished count is off", req.id));
            }
            let active: Vec<usize> = req.active_seqs().collect();
            // Parked for a KV connector's load: its one sequence holds device blocks.
            let loading = req.status == RequestStatus::WaitingForRemoteKvs;
            if loading && (req.seqs.len() != 1 || req.extras.remote_job == 0) {
                return Err(format!(
                    "request {} waits for remote KV without a load",
                    req.id
                ));
            }
            // Otherwise a transfer is a synchronous load of a request the step admitted.
            let job = req.extras.remote_job;
            if !loading && job != 0 && !(q == "running" && self.kv.is_syncing(job)) {
                return Err(format!(
                    "request {} ({q}) names transfer {job}, which loads nothing for it",
                    req.id
                ));
            }
            for (i, s) in req.seqs.iter().enumerate() {
                let holds = q == "running" || q == "swapped" || loading;
                let should_hold = holds && active.contains(&i);
                if self.mgr.contains(s.id) != should_hold {
                    return Err(format!(
                        "request {} seq {i} ({q}): manager holds it: {}",
                        req.id,
                        self.mgr.contains(s.id)
                    ));
                }
                if should_hold && self.mgr.is_swapped(s.id) != (q == "swapped") {
                    return Err(format!("request {} seq {i}: wrong pool", req.id));
                }
                if q == "running" && should_hold {
                    let table = self.mgr.block_table(s.id).map_err(|e| e.to_string())?;
                    if table != s.table.as_slice()
                        || s.table.last_block() != *table.last().unwrap_or(&0)
                    {
                        return Err(format!(
                            "request {} seq {i}: stale block table mirror",
                            req.id
                        ));
                    }
                    if s.table.num_blocks() != s.table.len() || req.first_seq_id + i as u64 != s.id
                    {
                        return Err(format!("request {} seq {i}: stale inline copies", req.id));
                    }
                    if s.tokens.last() != Some(&s.last_token) {
                        return Err(format!("request {} seq {i}: stale last_token", req.id));
                    }
                    if s.num_computed > s.tokens.len()
                        || s.num_computed > s.table.len() * self.mgr.block_size()
                    {
                        return Err(format!(
                            "request {} seq {i}: computed past its slots",
                            req.id
                        ));
                    }
                }
                let stale_progress = q == "waiting" && !s.is_finished() && s.num_computed != 0;
                if (!should_hold || loading) && (!s.table.is_empty() || stale_progress) {
                    return Err(format!("request {} seq {i}: holds state while {q}", req.id));
                }
            }
            if q == "running" {
                seats += req.seats();
            }
            held_by_requests += req.seqs.iter().filter(|s| self.mgr.contains(s.id)).count();
        }
        // Every other table is a finished or aborted request's, held for a connector's transfer.
        if self.mgr.num_sequences() != held_by_requests + self.kv.num_held_seqs() {
            return Err(format!(
                "the manager holds {} sequences: {held_by_requests} of live requests, {} held \
                 for transfers",
                self.mgr.num_sequences(),
                self.kv.num_held_seqs()
            ));
        }
        if seats != queues.running_seats {
            return Err(format!("running seats {} != {seats}", queues.running_seats));
        }
        // A KV connector's loading and loaded-not-admitted requests wait, each holding a seat.
        for h in self.kv.promoted() {
            if place.get(&h) != Some(&"waiting") {
                return Err(format!("promoted request slot {h} is not waiting"));
            }
        }
        let reserved = self.kv.reserved_seats(u32::MAX);
        if queues.running_seats + reserved > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running sequences and {reserved} seats held by loads exceed max_num_seqs={}",
                queues.running_seats, self.cfg.max_num_seqs
            ));
        }
        if queues.running_seats > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running sequences exceed max_num_seqs={}",
                queues.running_seats, self.cfg.max_num_seqs
            ));
        }
        let loras = self.running_loras();
        if loras > self.cfg.max_loras {
            return Err(format!(
                "{loras} adapters running exceed max_loras={}",
                self.cfg.max_loras
            ));
        }
        Ok(())
    }
}
