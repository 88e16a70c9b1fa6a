//! Requests in and out: `add_request` (argument checks, the request's state, the NEVER check
//! at the door) and `abort_request`.
use crate::error::{Error, Result};
use crate::kv::AllocStatus;

use super::state::request::{Request, RequestParams, RequestStatus};
use super::Scheduler;

impl Scheduler {
    /// Queues a request; returns its slot. `n` above `max_num_seqs` is an `InvalidArgument`
    /// error before anything is allocated. Unservable requests (prompt too long, more blocks
    /// than the pool) are accepted and reported as ignored by the next `schedule()`.
    pub fn add_request(&mut self, request_id: &str, mut params: RequestParams) -> Result<u32> {
        let bad = |m: String| {
            Err(Error::InvalidArgument(format!(
                "request {request_id:?}: {m}"
            )))
        };
        if params.prompt.is_empty() {
            return bad("empty prompt".into());
        }
        if self.store.handle_of(request_id).is_some() {
            return bad("duplicate request id".into());
        }
        if params.n == 0 {
            return bad("n must be >= 1".into());
        }
        if params.n > self.cfg.max_num_seqs {
            // checked before the n sequences are allocated: a huge n must not abort the process
            return bad(format!(
                "n={} exceeds max_num_seqs={} (the most sequences one request may have)",
                params.n, self.cfg.max_num_seqs
            ));
        }
        if params.stop.max_tokens == 0 {
            return bad("max_tokens must be >= 1".into());
        }
        if params.stop.min_tokens > params.stop.max_tokens {
            return bad(format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                params.stop.min_tokens, params.stop.max_tokens
            ));
        }
        if !params.arrival_time.is_finite() {
            return bad("arrival_time must be finite".into());
        }
        if params.lora_id != 0 && self.cfg.max_loras == 0 {
            return bad(format!(
                "lora_id={} but LoRA is off (max_loras=0)",
                params.lora_id
            ));
        }
        let (first_seq_id, order) = self.store.next_ids(params.n);
        let req = Request::new(
            request_id,
            &mut params,
            first_seq_id,
            order,
            self.cfg.max_model_len,
            self.cfg.max_seq_len(),
        );
        let ignore = self.unservable(&req);
        let h = self.store.place(req);
        match ignore {
            Some(reason) => {
                self.store.get_mut(h).status = RequestStatus::FinishedIgnored;
                self.queues.pending_ignored.push((h, reason));
            }
            None => self.queues.enqueue_waiting(h, &self.store),
        }
        Ok(h)
    }

    /// Reason a new request can never be served, if any.
    fn unservable(&self, req: &Request) -> Option<String> {
        let p = req.prompt_len;
        let max_seq_len = self.cfg.max_seq_len();
        if p > max_seq_len {
            let limit = if max_seq_len < self.cfg.max_model_len {
                format!(
                    "{max_seq_len} = min(max_model_len, max_num_batched_tokens), as \
                     prefill_first never splits a prompt"
                )
            } else {
                format!("max_model_len={max_seq_len}")
            };
            return Some(format!("prompt of {p} tokens is longer than {limit}"));
        }
        let slots = p + self.cfg.num_lookahead_slots;
        let bs = self.mgr.block_size();
        (self.mgr.can_allocate(slots) == AllocStatus::Never).then(|| {
            format!(
                "prompt of {p} tokens needs {} KV blocks of {bs} tokens, more than {}",
                slots.div_ceil(bs),
                self.pool_limit()
            )
        })
    }

    /// Removes a request from whichever queue holds it and frees everything it held.
    /// Unknown and finished ids are a no-op (returns false).
    pub fn abort_request(&mut self, request_id: &str) -> Result<bool> {
        let Some(h) = self.store.handle_of(request_id) else {
            return Ok(false);
        };
        if !self.queues.remove_request(h, &self.store) {
            return Ok(false);
        }
        self.store.get_mut(h).status = RequestStatus::FinishedAborted;
        self.release(h)?;
        self.counters.num_aborted += 1;
        Ok(true)
    }
}
