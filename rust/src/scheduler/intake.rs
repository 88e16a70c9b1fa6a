//! Requests in and out: `add_request` (the request rules, `validate_request`, owned here
//! alone; the request's state; the NEVER check at the door) and `abort_request`.
use crate::error::{Error, Result};
use crate::kv::AllocStatus;

use super::state::request::{Request, RequestParams, RequestStatus};
use super::Scheduler;

/// A request id as Python's `repr` shows it: every error about a request names it so
/// (`request 'a': ...`), whether the core or the bindings raise it.
pub fn request_repr(id: &str) -> String {
    let quote = if id.contains('\'') && !id.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(id.len() + 2);
    out.push(quote);
    for c in id.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// The error of a request asking for more sequences than `max_num_seqs`: `field` (`n`, or
/// the engine's `best_of`) and the value as given. The one text of the rule, also for Python
/// integers too large for the Rust type (the bindings).
pub fn too_many_seqs(field: &str, value: &dyn std::fmt::Display, max_num_seqs: usize) -> String {
    format!(
        "{field}={value} exceeds max_num_seqs={max_num_seqs} (the most sequences one request \
         may have)"
    )
}

impl Scheduler {
    /// Queues a request; returns its slot. A request `validate_request` refuses is an
    /// `InvalidArgument` error before anything is allocated. Unservable requests (prompt too
    /// long, more blocks than the pool) are accepted and reported as ignored by the next
    /// `schedule()`.
    pub fn add_request(&mut self, request_id: &str, params: RequestParams) -> Result<u32> {
        self.validate_request(request_id, &params)?;
        Ok(self.queue_request(request_id, params))
    }

    /// The request rules, without side effects (`add_request` applies them first; the engine
    /// asks them before it builds its own per-sequence state): a new id, a non-empty prompt,
    /// `1 <= n <= max_num_seqs`, `1 <= max_tokens`, `min_tokens <= max_tokens`, a finite
    /// arrival time, an adapter only with LoRA on. Each error names the request, the field
    /// and the limit.
    pub fn validate_request(&self, request_id: &str, params: &RequestParams) -> Result<()> {
        self.check_request(request_id, params, "n")
    }

    /// `validate_request`, naming the sequence count `n_field` (the bindings' `best_of`).
    pub(crate) fn check_request(
        &self,
        request_id: &str,
        params: &RequestParams,
        n_field: &str,
    ) -> Result<()> {
        let bad = |m: String| {
            Err(Error::InvalidArgument(format!(
                "request {}: {m}",
                request_repr(request_id)
            )))
        };
        if params.prompt.is_empty() {
            return bad("empty prompt".into());
        }
        if self.store.handle_of(request_id).is_some() {
            return bad("duplicate request id".into());
        }
        if params.n == 0 {
            return bad(format!("{n_field} must be >= 1"));
        }
        let max_num_seqs = self.cfg.max_num_seqs;
        if params.n > max_num_seqs {
            // checked before the n sequences are allocated: a huge n must not abort the process
            return bad(too_many_seqs(n_field, &params.n, max_num_seqs));
        }
        let stop = &params.stop;
        if stop.max_tokens == 0 {
            return bad("max_tokens must be >= 1".into());
        }
        if stop.min_tokens > stop.max_tokens {
            return bad(format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                stop.min_tokens, stop.max_tokens
            ));
        }
        if !params.arrival_time.is_finite() {
            return bad(format!(
                "arrival_time must be a finite number of seconds, got {}",
                params.arrival_time
            ));
        }
        if params.lora_id != 0 && self.cfg.max_loras == 0 {
            return bad(format!(
                "lora_id={} given but LoRA is not enabled (max_loras=0; the engine's \
                 enable_lora=True / --enable-lora)",
                params.lora_id
            ));
        }
        Ok(())
    }

    /// Queues a request `check_request` accepted; returns its slot.
    pub(crate) fn queue_request(&mut self, request_id: &str, mut params: RequestParams) -> u32 {
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
        h
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
