//! Beam search's reshuffle between a step's forward and its update: each beam of a request
//! continues the beam it was chosen from, by a copy-on-write fork of that beam's blocks (no
//! prompt or history is computed again); the beams nobody continues give their blocks back.
use crate::error::{Error, Result};

use crate::scheduler::state::request::RequestStatus;
use crate::scheduler::Scheduler;

impl Scheduler {
    /// Before `update_from_output` of the latest step (`step`): sequence `i` of `request_id`
    /// becomes a copy of sequence `parents[i]` (its tokens, its progress, its blocks shared
    /// copy-on-write), so the token sampled for `i` extends its parent's history. A parent
    /// keeps its own place (`parents[parents[i]] == parents[i]`); `parents[i] == i` leaves
    /// `i` as it is. Every unfinished sequence must have computed all its tokens (sampled in
    /// this step). Returns how many sequences were forked.
    pub fn fork_beams(&mut self, step: u64, request_id: &str, parents: &[usize]) -> Result<usize> {
        self.ledger.check_latest(step)?;
        let h = self.store.handle_of(request_id).ok_or_else(|| {
            Error::InvalidArgument(format!("fork_beams: unknown request {request_id:?}"))
        })?;
        self.check_beam_parents(h, request_id, parents)?;
        if parents.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(0);
        }
        // The tables of forked sequences change: outputs still listing them get snapshots.
        self.recorder.materialize_pending(&self.store);
        let bs = self.mgr.block_size();
        let req = self.store.get_mut(h);
        let mut forked = 0;
        for (i, &p) in parents.iter().enumerate() {
            if i == p {
                continue;
            }
            let (parent_id, child_id) = (req.seqs[p].id, req.seqs[i].id);
            if self.mgr.contains(child_id) {
                self.mgr.free(child_id)?;
            }
            self.mgr.fork(parent_id, child_id)?;
            let parent = req.seqs[p].clone();
            let shared_tail = parent.table.len() * bs > parent.num_computed;
            let child = &mut req.seqs[i];
            child.tokens.clone_from(&parent.tokens);
            child.last_token = parent.last_token;
            child.num_computed = parent.num_computed;
            child.table.set(&parent.table);
            child.tail_shared = shared_tail;
            req.seqs[p].tail_shared |= shared_tail;
            forked += 1;
        }
        Ok(forked)
    }

    fn check_beam_parents(&self, h: u32, request_id: &str, parents: &[usize]) -> Result<()> {
        let req = self.store.get(h);
        let bad = |why: String| {
            Err(Error::InvalidArgument(format!(
                "fork_beams {request_id:?}: {why}"
            )))
        };
        if req.status != RequestStatus::Running {
            return bad(format!(
                "the request is {}, not running",
                req.status.as_str()
            ));
        }
        if parents.len() != req.seqs.len() {
            return bad(format!(
                "{} parents for {} sequences",
                parents.len(),
                req.seqs.len()
            ));
        }
        for (i, &p) in parents.iter().enumerate() {
            let Some(parent) = req.seqs.get(p) else {
                return bad(format!("parent {p} of sequence {i} is out of range"));
            };
            if parents[p] != p {
                return bad(format!(
                    "parent {p} of sequence {i} does not keep its place"
                ));
            }
            let s = &req.seqs[i];
            if i != p && (s.is_finished() || parent.is_finished()) {
                return bad(format!("sequence {i} or its parent {p} is finished"));
            }
            if i != p && (!req.forked || parent.num_computed != parent.tokens.len()) {
                return bad(format!(
                    "parent {p} of sequence {i} has tokens still to compute"
                ));
            }
        }
        Ok(())
    }
}
