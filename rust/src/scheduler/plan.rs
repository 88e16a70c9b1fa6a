//! Per-request work of one step: how many tokens each sequence computes (within the token
//! budget), how many blocks that takes, and applying it (appends, CoW, prefix-cache
//! registration, the n>1 fork, samples). Shared by the three strategies.
use crate::error::{Error, Result};
use crate::ids::BlockId;
use crate::kv::{AllocStatus, PrefixHit};

use super::output::{StepOutput, TableRow};
use super::request::Sequence;
use super::{Admit, Scheduler};

/// Whether a request's tokens may be cut to the remaining budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cut {
    /// Chunking strategies: each sequence takes what budget (and the long-prefill threshold)
    /// allows.
    Split,
    /// `prefill_first`: all of a sequence's tokens this step, or none of them.
    Whole,
}

/// One single-token decode of the fast path, recorded into the step arrays in bulk by
/// `flush_decodes` (per-array tight loops instead of ~16 scattered pushes per sequence).
/// Fast-path decodes queued before `flush_decodes` records them (64 x 40 B stays in L1).
const DECODE_BATCH: usize = 64;

#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeRow {
    seq_id: u64,
    slot: i64,
    handle: u32,
    gen: u32,
    pos: u32,
    token: u32,
    table_len: u32,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct PlanItem {
    seq: u32,
    take: u32,
    /// The manager must grow the table or copy a shared block first.
    call: bool,
    /// Batch row once recorded.
    row: u32,
}

/// Records one scheduled sequence's row. The per-token arrays are built from it on access
/// (`Scheduler::input_ids` / `slot_mapping`, `StepOutput::positions`); a single-token row
/// keeps its token and slot inline.
#[inline]
#[allow(clippy::too_many_arguments)]
fn record(
    out: &mut StepOutput,
    handle: u32,
    gen: u32,
    index: u32,
    s: &Sequence,
    start: usize,
    take: usize,
    bs: usize,
) {
    out.seq_ids.push(s.id as i64);
    out.handles.push(handle);
    out.gens.push(gen);
    out.seq_index.push(index as i32);
    out.num_tokens.push(take as i32);
    out.start_pos.push(start as i32);
    let (token, slot) = if take == 1 {
        (
            s.tokens[start],
            (s.table[start / bs] as usize * bs + start % bs) as i64,
        )
    } else {
        (0, 0)
    };
    out.table_rows.push(TableRow {
        handle,
        seq: index,
        len: s.table.len() as u32,
        start: start as u32,
        n: take as u32,
        token,
        slot,
    });
    out.num_batched_tokens += take;
}

impl Scheduler {
    fn chunk_cap(&self) -> usize {
        match self.cfg.long_prefill_token_threshold {
            0 => usize::MAX,
            t => t,
        }
    }

    /// Plans request `h`'s tokens for this step into `self.plan` from a budget of `budget`
    /// tokens. Returns (tokens, blocks the manager must provide); (0, 0) when nothing fits.
    pub(super) fn plan_request(&mut self, h: u32, budget: usize, cut: Cut) -> (usize, usize) {
        let bs = self.block_size;
        let la = self.cfg.num_lookahead_slots;
        let cap = self.chunk_cap();
        let max_model_len = self.cfg.max_model_len;
        let mut plan = std::mem::take(&mut self.plan);
        plan.clear();
        self.cow_scratch.clear();
        let req = self.slots[h as usize]
            .req
            .as_ref()
            .expect("planned request exists");
        let fork_pending = req.needs_fork();
        let leader = req.leader();
        // A swapped-out group is planned over its host tables (same shape and sharing as
        // the device tables it gets back), so a swap-in can be sized before it happens.
        let swapped = req.status == super::RequestStatus::Swapped;
        let (mut left, mut tokens, mut needed) = (budget, 0usize, 0usize);
        for (i, s) in req.seqs.iter().enumerate() {
            if s.is_finished() || (!req.forked && i != leader) {
                continue;
            }
            let target = if fork_pending {
                req.prompt_len
            } else {
                s.tokens.len()
            };
            // Never compute a position at or past max_model_len. (V1 stops one earlier; here
            // a prompt of exactly max_model_len must still compute its last token to sample.)
            let want = target
                .saturating_sub(s.num_computed)
                .min(max_model_len.saturating_sub(s.num_computed));
            if want == 0 {
                continue;
            }
            // `Whole` is all-or-nothing per sequence: a group's sequences may re-prefill in
            // different steps, so a group never needs more than one sequence's worth at once.
            let take = match cut {
                Cut::Split => want.min(left).min(cap),
                Cut::Whole if want <= left => want,
                Cut::Whole => break,
            };
            if take == 0 {
                break;
            }
            left -= take;
            let end = s.num_computed + take + la;
            let blocks = end.div_ceil(bs);
            let table: &[BlockId] = if swapped {
                self.mgr.block_table(s.id).unwrap_or(&[])
            } else {
                &s.table
            };
            let have = table.len();
            let grow = blocks.saturating_sub(have);
            // Exact CoW count: a block shared by k sequences is copied by the first k - 1
            // writers only (the conservative one-per-sequence count can livelock a group
            // that was just swapped back in).
            let mut cow = 0;
            if s.tail_shared {
                for &b in &table[(s.num_computed / bs).min(have)..blocks.min(have)] {
                    let refs = if swapped {
                        self.mgr.host_ref_count(b)
                    } else {
                        self.mgr.device_ref_count(b)
                    };
                    let refs = refs.unwrap_or(1) as usize;
                    let copied = self.cow_scratch.iter().filter(|&&c| c == b).count();
                    if refs - copied.min(refs) > 1 {
                        cow += 1;
                        self.cow_scratch.push(b);
                    }
                }
            }
            needed += grow + cow;
            tokens += take;
            plan.push(PlanItem {
                seq: i as u32,
                take: take as u32,
                call: grow + cow > 0,
                row: 0,
            });
        }
        self.plan = plan;
        (tokens, needed)
    }

    /// The common case: a single-sequence request decoding one token into a block it
    /// already owns alone. Queues the row in `decode_rows` (see `flush_decodes`); returns
    /// false (nothing done) for anything else.
    #[inline]
    fn try_fast_decode(&mut self, h: u32) -> Result<bool> {
        let bs = self.block_size;
        let la = self.cfg.num_lookahead_slots;
        let slot = &mut self.slots[h as usize];
        let gen = slot.gen;
        let req = slot.req.as_mut().expect("running request exists");
        if req.seqs.len() != 1 {
            return Ok(false);
        }
        let s = &mut req.seqs[0];
        let start = s.num_computed;
        if s.tail_shared || s.tokens.len() != start + 1 || start + 1 > self.cfg.max_model_len {
            return Ok(false);
        }
        if start + 1 + la > s.table.num_blocks() * bs {
            // Also common (1 in block_size steps per sequence): the token opens a fresh
            // block. With no lookahead and a free block that is a plain append (nothing
            // shared is written, so no CoW); anything else takes the general path.
            if la != 0
                || start != s.table.num_blocks() * bs
                || self.mgr.num_free_device_blocks() == 0
            {
                return Ok(false);
            }
            if !self.pending_fills.is_empty() && self.mgr.num_uncached_free_device_blocks() == 0 {
                // This open evicts a cached block: queued registrations go first, as they
                // would have without batching.
                return Ok(false);
            }
            // Same as append_slots(start, start + 1) here: start is the table's capacity.
            let Some(block) = self.mgr.append_fresh_block(s.id)? else {
                return Err(Error::InvalidState(format!(
                    "request {}: no fresh block after the free-block check",
                    req.id
                )));
            };
            debug_assert!(self
                .mgr
                .block_table(s.id)
                .is_ok_and(|t| t.len() == s.table.len() + 1 && t.starts_with(&s.table)));
            s.table.push(block);
        }
        // Decoding writes into the last block unless lookahead slots reach past it; that
        // case needs neither the table's allocation nor a division.
        let tail_start = (s.table.num_blocks() - 1) * bs;
        let (block, offset) = if start >= tail_start {
            (s.table.last_block(), start - tail_start)
        } else {
            (s.table[start / bs], start % bs)
        };
        self.decode_rows.push(DecodeRow {
            // seqs[0]: its id is the request's first (read from the slot's hot line).
            seq_id: req.first_seq_id,
            slot: (block as usize * bs + offset) as i64,
            handle: h,
            gen,
            pos: start as u32,
            // tokens.len() == start + 1 was checked above, so this is tokens[start].
            token: s.last_token,
            table_len: s.table.num_blocks() as u32,
        });
        s.num_computed = start + 1;
        if self.caching && offset + 1 == bs {
            // Registered in batches by `flush_fills` (same order, before anything else can
            // touch the prefix cache).
            self.pending_fills.push((h, (start + 1) as u32));
        }
        Ok(true)
    }

    /// Registers the blocks filled by queued fast-path decodes (queue order), in one batch.
    pub(super) fn flush_fills(&mut self) -> Result<()> {
        if self.pending_fills.is_empty() {
            return Ok(());
        }
        let slots = &self.slots;
        let items: Vec<_> = self
            .pending_fills
            .iter()
            .map(|&(h, n)| {
                let req = slots[h as usize]
                    .req
                    .as_ref()
                    .expect("a queued fill's request is running");
                let s = &req.seqs[0];
                (s.id, &s.tokens[..], n as usize, req.extra_key)
            })
            .collect();
        self.mgr.cache_full_blocks_batch(&items)?;
        self.pending_fills.clear();
        Ok(())
    }

    /// Records the queued fast-path decodes (rows and samples, in queue order) into `out`.
    /// Must run before anything else appends rows or samples, to keep the batch order.
    pub(super) fn flush_decodes(&mut self, out: &mut StepOutput) {
        let rows = &self.decode_rows;
        let n = rows.len();
        if n == 0 {
            return;
        }
        let base = out.seq_ids.len();
        out.seq_ids.extend(rows.iter().map(|r| r.seq_id as i64));
        out.handles.extend(rows.iter().map(|r| r.handle));
        out.gens.extend(rows.iter().map(|r| r.gen));
        out.seq_index.resize(base + n, 0);
        out.num_tokens.resize(base + n, 1);
        out.start_pos.extend(rows.iter().map(|r| r.pos as i32));
        out.table_rows.extend(rows.iter().map(|r| TableRow {
            handle: r.handle,
            seq: 0,
            len: r.table_len,
            start: r.pos,
            n: 1,
            token: r.token,
            slot: r.slot,
        }));
        out.num_batched_tokens += n;
        out.sample_rows.extend((base as i64)..((base + n) as i64));
        out.sample_seq_ids.extend_from_slice(&out.seq_ids[base..]);
        out.sample_handles.extend_from_slice(&out.handles[base..]);
        out.sample_gens.extend_from_slice(&out.gens[base..]);
        let k = out.sample_seq_index.len();
        out.sample_seq_index.resize(k + n, 0);
        self.decode_rows.clear();
    }

    /// Carries out `self.plan` for request `h`: grows tables (CoW pairs into the output),
    /// records the tokens, registers newly full blocks in the prefix cache, forks the
    /// siblings when the shared prompt completes, and lists the samples to draw.
    pub(super) fn apply_plan(&mut self, h: u32, out: &mut StepOutput) -> Result<()> {
        let bs = self.block_size;
        let la = self.cfg.num_lookahead_slots;
        let caching = self.caching;
        let mut plan = std::mem::take(&mut self.plan);
        let gen = self.slots[h as usize].gen;
        for item in plan.iter_mut() {
            let (id, start) = {
                let s = &self.slots[h as usize]
                    .req
                    .as_ref()
                    .expect("planned request exists")
                    .seqs[item.seq as usize];
                (s.id, s.num_computed)
            };
            let take = item.take as usize;
            let end = start + take;
            if item.call {
                let Some(pairs) = self.mgr.append_slots(id, start, end + la)? else {
                    return Err(Error::InvalidState(format!(
                        "request {}: append_slots found no blocks after the free-block check",
                        self.req(h).id
                    )));
                };
                for (src, dst) in pairs {
                    out.blocks_to_copy.push(src as i64);
                    out.blocks_to_copy.push(dst as i64);
                }
                // A CoW replaces a block that earlier outputs may list: snapshot them first.
                let old = &self.req(h).seqs[item.seq as usize].table;
                if !self.mgr.block_table(id)?.starts_with(old) {
                    self.materialize_pending();
                }
                let s = &mut self.slots[h as usize]
                    .req
                    .as_mut()
                    .expect("planned request exists")
                    .seqs[item.seq as usize];
                s.tail_shared = false;
                s.table.set(self.mgr.block_table(id)?);
            }
            let req = self.slots[h as usize]
                .req
                .as_mut()
                .expect("planned request exists");
            let extra_key = req.extra_key;
            let s = &mut req.seqs[item.seq as usize];
            item.row = out.seq_ids.len() as u32;
            record(out, h, gen, item.seq, s, start, take, bs);
            s.num_computed = end;
            // Register at schedule time so later admissions of this very step share the block.
            if caching && end / bs > start / bs {
                self.mgr
                    .cache_full_blocks(s.id, &s.tokens, end, extra_key)?;
            }
        }
        let mgr = &mut self.mgr;
        let req = self.slots[h as usize]
            .req
            .as_mut()
            .expect("planned request exists");
        let leader = req.leader();
        let mut forked_now = false;
        if req.needs_fork() && req.seqs[leader].num_computed >= req.prompt_len {
            // The prompt is complete: siblings share every block; the shared partial tail
            // (if any) is copied by whoever appends to it first, in a later step.
            let (leader_id, computed) = (req.seqs[leader].id, req.seqs[leader].num_computed);
            let table = req.seqs[leader].table.clone();
            let shared_tail = table.len() * bs > computed;
            for (i, s) in req.seqs.iter_mut().enumerate() {
                if i == leader || s.is_finished() {
                    continue;
                }
                mgr.fork(leader_id, s.id)?;
                s.table.set(&table);
                s.num_computed = computed;
                s.tail_shared = shared_tail;
            }
            req.seqs[leader].tail_shared = shared_tail;
            req.forked = true;
            forked_now = true;
        }
        let leader_row = plan
            .iter()
            .find(|p| p.seq as usize == leader)
            .map(|p| p.row);
        for (i, s) in req.seqs.iter().enumerate() {
            if s.is_finished() || s.num_computed != s.tokens.len() {
                continue;
            }
            let own = plan.iter().find(|p| p.seq as usize == i).map(|p| p.row);
            let row = match own {
                Some(r) => Some(r),
                None if forked_now => leader_row,
                None => None,
            };
            if let Some(row) = row {
                out.push_sample(row as usize, s.id, h, gen, i);
            }
        }
        self.plan = plan;
        Ok(())
    }

    /// Tries to admit the head of `waiting` (`h`): NEVER check, prefix lookup, allocation
    /// of its first chunk (keeping the watermark), then its tokens.
    pub(super) fn try_admit(
        &mut self,
        h: u32,
        budget: usize,
        cut: Cut,
        out: &mut StepOutput,
    ) -> Result<Admit> {
        let la = self.cfg.num_lookahead_slots;
        let cap = self.chunk_cap();
        let (leader, target, seq_id) = {
            let req = self.req(h);
            let l = req.leader();
            (l, req.leader_target(), req.seqs[l].id)
        };
        if let Some(reason) = self.group_never_fits(h) {
            return Ok(Admit::Never(reason));
        }
        let hit = if self.caching {
            let req = self.slots[h as usize]
                .req
                .as_ref()
                .expect("admitted request exists");
            self.mgr
                .lookup_prefix(&req.seqs[leader].tokens[..target], req.extra_key)
        } else {
            PrefixHit::default()
        };
        let computed = hit.num_cached_tokens;
        let want = target - computed;
        let take = match cut {
            Cut::Split => want.min(budget).min(cap),
            Cut::Whole if want <= budget => want,
            Cut::Whole => 0,
        };
        if take == 0 {
            return Ok(Admit::NoBudget);
        }
        if !self
            .mgr
            .allocate_owned(seq_id, hit, computed + take + la, true)?
        {
            return Ok(Admit::Later);
        }
        {
            let req = self.slots[h as usize]
                .req
                .as_mut()
                .expect("admitted request exists");
            let s = &mut req.seqs[leader];
            s.table.set(self.mgr.block_table(seq_id)?);
            s.num_computed = computed;
            s.tail_shared = false;
            if !req.admitted_once {
                req.admitted_once = true;
                req.num_cached_tokens = computed;
            }
        }
        self.plan.clear();
        self.plan.push(PlanItem {
            seq: leader as u32,
            take: take as u32,
            call: false,
            row: 0,
        });
        self.apply_plan(h, out)?;
        Ok(Admit::Admitted(take))
    }

    /// Admits waiting requests in queue order while the budget, `max_num_seqs` and the
    /// pool allow; they join the tail of `running`. Returns whether any was admitted.
    pub(super) fn admit_waiting(
        &mut self,
        left: &mut usize,
        cut: Cut,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let mut any = false;
        while let Some(&h) = self.waiting.front() {
            if *left == 0 || !self.admission_open_for(h) {
                break;
            }
            if self.running_seats + self.req(h).seats() > self.cfg.max_num_seqs {
                break;
            }
            match self.try_admit(h, *left, cut, out)? {
                Admit::Admitted(tokens) => {
                    *left -= tokens;
                    self.admit_head(h);
                    self.running.push(h);
                    any = true;
                }
                Admit::Later | Admit::NoBudget => break,
                Admit::Never(reason) => {
                    self.waiting.pop_front();
                    self.finish_ignored(h, reason, out)?;
                }
            }
        }
        Ok(any)
    }

    /// Walks `running` in order giving each request its tokens; when blocks run out,
    /// preempts from the tail (the lowest-ranked) until the current request fits or is
    /// itself preempted. Under `Cut::Whole` the walk stops at the first request the budget
    /// cannot take whole. Returns whether anything was preempted.
    pub(super) fn schedule_running(
        &mut self,
        left: &mut usize,
        cut: Cut,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let mut preempted = false;
        // Left over only by a step that failed midway; registering is optional caching.
        self.pending_fills.clear();
        let mut i = 0;
        while i < self.running.len() && *left > 0 {
            let h = self.running[i];
            if self.try_fast_decode(h)? {
                *left -= 1;
                i += 1;
                // Flush in small batches: `flush_decodes` makes one pass over the queued rows
                // per output array, and a step's worth of rows (40 B each) would no longer
                // fit in L1 between passes.
                if self.decode_rows.len() >= DECODE_BATCH {
                    self.flush_decodes(out);
                    self.flush_fills()?;
                }
                continue;
            }
            self.flush_decodes(out);
            self.flush_fills()?;
            let (tokens, needed) = self.plan_request(h, *left, cut);
            if tokens == 0 {
                if cut == Cut::Whole {
                    break;
                }
                i += 1;
                continue;
            }
            loop {
                if needed == 0 || needed <= self.mgr.num_free_device_blocks() {
                    self.apply_plan(h, out)?;
                    *left -= tokens;
                    i += 1;
                    break;
                }
                if self.running.len() == 1 {
                    // Alone and still short: only this request holds device blocks, so it
                    // can never grow. Preempting it would only bring it back (a livelock).
                    self.running.pop();
                    self.running_seats -= self.req(h).seats();
                    let reason = format!(
                        "needs {needed} more KV blocks with the whole cache ({} blocks) to \
                         itself",
                        self.num_device_blocks
                    );
                    self.finish_ignored(h, reason, out)?;
                    break;
                }
                let victim = self
                    .running
                    .pop()
                    .expect("running holds the current request");
                self.preempt(victim, out, false)?;
                preempted = true;
                if victim == h {
                    break;
                }
            }
        }
        self.flush_decodes(out);
        self.flush_fills()?;
        Ok(preempted)
    }

    /// Brings swapped groups back (queue order) while `max_num_seqs`, the budget and the
    /// pool allow; each joins the tail of `running` and computes its tokens in this very
    /// step: a group is swapped in only when the pool holds its blocks *and* the slots of
    /// those tokens (vLLM V0's `can_swap_in` with lookahead), else it would be swapped out
    /// again next step without having advanced. A group that can never fit again finishes
    /// as ignored.
    pub(super) fn swap_in_groups(
        &mut self,
        left: &mut usize,
        cut: Cut,
        out: &mut StepOutput,
    ) -> Result<()> {
        while let Some(&h) = self.swapped.front() {
            if *left == 0 {
                break;
            }
            let seats = self.req(h).seats();
            if self.running_seats + seats > self.cfg.max_num_seqs {
                break;
            }
            self.seq_scratch.clear();
            {
                let req = self.slots[h as usize]
                    .req
                    .as_ref()
                    .expect("swapped request exists");
                self.seq_scratch
                    .extend(req.active_seqs().map(|i| req.seqs[i].id));
            }
            let keep_watermark = !self.running.is_empty();
            let (mut tokens, mut needed) = self.plan_request(h, *left, cut);
            let mut status = self.swap_in_status(tokens, needed, keep_watermark);
            if status != AllocStatus::Ok && cut == Cut::Split && tokens > 1 {
                // A group swapped out mid-prompt may still fit with a one-token chunk.
                (tokens, needed) = self.plan_request(h, 1, cut);
                status = self.swap_in_status(tokens, needed, keep_watermark);
            }
            if tokens == 0 {
                // `Whole` and the budget cannot take its tokens: it waits, keeping its place.
                break;
            }
            match status {
                AllocStatus::Later => break,
                AllocStatus::Never => {
                    self.swapped.pop_front();
                    let reason = format!(
                        "swapped-out group needs more KV blocks than the device pool has ({} \
                         blocks) to compute its next tokens",
                        self.num_device_blocks
                    );
                    self.finish_ignored(h, reason, out)?;
                    continue;
                }
                AllocStatus::Ok => {}
            }
            self.swapped.pop_front();
            let pairs = self.mgr.swap_in(&self.seq_scratch)?;
            for (host, device) in pairs {
                out.blocks_to_swap_in.push(host as i64);
                out.blocks_to_swap_in.push(device as i64);
            }
            {
                let req = self.slots[h as usize]
                    .req
                    .as_mut()
                    .expect("swapped request exists");
                let active: Vec<usize> = req.active_seqs().collect();
                for i in active {
                    let s = &mut req.seqs[i];
                    s.table.set(self.mgr.block_table(s.id)?);
                }
                req.status = super::RequestStatus::Running;
            }
            self.running_seats += seats;
            self.running.push(h);
            // The plan made over the host tables holds for the device tables (same shape
            // and sharing), and the blocks it needs were counted above.
            self.apply_plan(h, out)?;
            *left -= tokens;
        }
        Ok(())
    }

    /// Swap-in verdict for the group in `seq_scratch` that would then compute `tokens`
    /// needing `needed` more blocks.
    fn swap_in_status(&self, tokens: usize, needed: usize, keep_watermark: bool) -> AllocStatus {
        if tokens == 0 {
            return AllocStatus::Later;
        }
        self.mgr
            .can_swap_in_and_grow(&self.seq_scratch, needed, keep_watermark)
    }
}
