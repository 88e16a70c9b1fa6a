//! Per-request work of one step, shared by the strategies: how many tokens each sequence
//! computes within the budget and how many blocks that takes (`plan_request`), and carrying
//! it out (`apply_plan`: appends and CoW through the manager, the rows, prefix-cache
//! registration, the n > 1 fork, the samples).
use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv::KvCacheManager;

use super::budget::Cut;
use crate::scheduler::output::record::record;
use crate::scheduler::output::StepOutput;
use crate::scheduler::state::request::{Request, RequestStatus, Sequence};
use crate::scheduler::Scheduler;

/// One sequence's share of the step.
#[derive(Debug, Clone, Copy)]
pub(super) struct PlanItem {
    seq: u32,
    take: u32,
    /// Draft tokens computed after the `take` tokens (speculative decoding), not counted as
    /// computed until verified.
    drafts: u32,
    /// The manager must grow the table or copy a shared block first.
    call: bool,
    /// Batch row once recorded.
    row: u32,
}

/// The plan being made for one request, and scratch reused across steps.
#[derive(Debug, Default)]
pub(in crate::scheduler) struct Planner {
    items: Vec<PlanItem>,
    /// Shared blocks already counted for a copy by this plan.
    cow: Vec<BlockId>,
    /// Sequence ids of the group being swapped out or in.
    pub(super) group: Vec<SeqId>,
}

impl Planner {
    /// A plan of one sequence taking `take` tokens, with its blocks already in place (an
    /// admission allocates them before planning).
    pub(super) fn plan_one(&mut self, seq: usize, take: usize) {
        self.items.clear();
        self.items.push(PlanItem {
            seq: seq as u32,
            take: take as u32,
            drafts: 0,
            call: false,
            row: 0,
        });
    }

    /// Lists the ids of `req`'s sequences that hold (or are about to hold) blocks in `group`.
    pub(super) fn group_of(&mut self, req: &Request) {
        self.group.clear();
        self.group.extend(req.active_seqs().map(|i| req.seqs[i].id));
    }
}

/// Refreshes a sequence's mirror from the manager's device table (after an allocation, a
/// CoW, a swap-in).
pub(super) fn sync_mirror(mgr: &KvCacheManager, s: &mut Sequence) -> Result<()> {
    s.table.set(mgr.block_table(s.id)?);
    Ok(())
}

impl Scheduler {
    /// Tokens one sequence may compute per step (`long_prefill_token_threshold`; 0 = none).
    pub(super) fn chunk_cap(&self) -> usize {
        match self.cfg.long_prefill_token_threshold {
            0 => usize::MAX,
            t => t,
        }
    }

    /// Plans request `h`'s tokens for this step from a budget of `budget` tokens. Returns
    /// (tokens, blocks the manager must provide); (0, 0) when nothing fits.
    pub(super) fn plan_request(&mut self, h: u32, budget: usize, cut: Cut) -> (usize, usize) {
        let bs = self.mgr.block_size();
        let la = self.cfg.num_lookahead_slots;
        let cap = self.chunk_cap();
        let max_model_len = self.cfg.max_model_len;
        let groups = self.mgr.num_groups();
        let planner = &mut self.planner;
        planner.items.clear();
        planner.cow.clear();
        let req = self.store.get(h);
        let fork_pending = req.needs_fork();
        let leader = req.leader();
        // A swapped-out group is planned over its host tables (same shape and sharing as
        // the device tables it gets back), so a swap-in can be sized before it happens.
        let swapped = req.status == RequestStatus::Swapped;
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
            let take = cut.take(want, left, cap);
            if take == 0 {
                break;
            }
            left -= take;
            // Drafts ride on a decode that fits whole, trimmed to the budget, the chunk cap
            // and the model length; their slots come out of (or beyond) the lookahead slots.
            let drafts = if take == want && !fork_pending && s.tokens.len() == s.num_computed + 1 {
                self.spec
                    .pending_count(h, s.id)
                    .min(left)
                    .min(cap - take)
                    .min(max_model_len.saturating_sub(s.num_computed + take))
            } else {
                0
            };
            left -= drafts;
            let end = s.num_computed + take + la.max(drafts);
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
                    let copied = planner.cow.iter().filter(|&&c| c == b).count();
                    if refs - copied.min(refs) > 1 {
                        cow += 1;
                        planner.cow.push(b);
                    }
                }
            }
            // Every layer group grows and copies alike (a window's releases not counted).
            needed += (grow + cow) * groups;
            tokens += take + drafts;
            planner.items.push(PlanItem {
                seq: i as u32,
                take: take as u32,
                drafts: drafts as u32,
                call: grow + cow > 0,
                row: 0,
            });
        }
        (tokens, needed)
    }

    /// Carries out the plan for request `h`: grows tables (CoW pairs into the output),
    /// records the tokens, registers newly full blocks in the prefix cache, forks the
    /// siblings when the shared prompt completes, and lists the samples to draw.
    pub(super) fn apply_plan(&mut self, h: u32, out: &mut StepOutput) -> Result<()> {
        let bs = self.mgr.block_size();
        let la = self.cfg.num_lookahead_slots;
        let caching = self.caching();
        let mut items = std::mem::take(&mut self.planner.items);
        let gen = self.store.gen(h);
        for item in items.iter_mut() {
            let (id, start) = {
                let s = &self.store.get(h).seqs[item.seq as usize];
                (s.id, s.num_computed)
            };
            let (take, drafts) = (item.take as usize, item.drafts as usize);
            let end = start + take;
            if item.call {
                self.grow(h, item.seq as usize, start, end + la.max(drafts), out)?;
            }
            let req = self.store.get_mut(h);
            let extra_key = req.extra_key;
            let s = &mut req.seqs[item.seq as usize];
            item.row = out.seq_ids.len() as u32;
            record(out, h, gen, item.seq, s, start, take + drafts, bs);
            if drafts > 0 {
                self.spec
                    .note_row(out, item.row, (h, id), s.tokens[start], drafts);
            }
            s.num_computed = end;
            // Register at schedule time so later admissions of this very step share the block.
            if caching && end / bs > start / bs {
                self.mgr.cache_full_blocks(id, &s.tokens, end, extra_key)?;
            }
        }
        let forked_now = self.fork_if_prompt_done(h)?;
        self.push_samples(h, gen, &items, forked_now, out);
        self.planner.items = items;
        Ok(())
    }

    /// Grows sequence `seq` of request `h` (computed up to `start`) to `slots` slots through
    /// the manager; copy-on-write pairs go into `out`.
    fn grow(
        &mut self,
        h: u32,
        seq: usize,
        start: usize,
        slots: usize,
        out: &mut StepOutput,
    ) -> Result<()> {
        let id = self.store.get(h).seqs[seq].id;
        let Some(pairs) = self.mgr.append_slots(id, start, slots)? else {
            return Err(Error::InvalidState(format!(
                "request {}: append_slots found no blocks after the free-block check",
                self.store.get(h).id
            )));
        };
        StepOutput::push_pairs(&mut out.blocks_to_copy, pairs);
        // A CoW replaces a block that earlier outputs may list: snapshot them first.
        let old = &self.store.get(h).seqs[seq].table;
        if !self.mgr.block_table(id)?.starts_with(old) {
            self.recorder.materialize_pending(&self.store);
        }
        let s = &mut self.store.get_mut(h).seqs[seq];
        s.tail_shared = false;
        sync_mirror(&self.mgr, s)
    }

    /// Once the leader has computed the shared prompt, the siblings are forked from it: they
    /// share every block; the shared partial tail (if any) is copied by whoever appends to
    /// it first, in a later step. Returns whether it forked now.
    fn fork_if_prompt_done(&mut self, h: u32) -> Result<bool> {
        let bs = self.mgr.block_size();
        let req = self.store.get_mut(h);
        let leader = req.leader();
        if !(req.needs_fork() && req.seqs[leader].num_computed >= req.prompt_len) {
            return Ok(false);
        }
        let (leader_id, computed) = (req.seqs[leader].id, req.seqs[leader].num_computed);
        let table = req.seqs[leader].table.clone();
        let shared_tail = table.len() * bs > computed;
        for (i, s) in req.seqs.iter_mut().enumerate() {
            if i == leader || s.is_finished() {
                continue;
            }
            self.mgr.fork(leader_id, s.id)?;
            s.table.set(&table);
            s.num_computed = computed;
            s.tail_shared = shared_tail;
        }
        req.seqs[leader].tail_shared = shared_tail;
        req.forked = true;
        Ok(true)
    }

    /// Lists the samples request `h` draws this step: every unfinished sequence that has
    /// computed all its tokens samples from its own row (a sibling forked this step, from
    /// the leader's).
    fn push_samples(
        &self,
        h: u32,
        gen: u32,
        items: &[PlanItem],
        forked_now: bool,
        out: &mut StepOutput,
    ) {
        let req = self.store.get(h);
        let leader = req.leader();
        let row_of = |i: usize| items.iter().find(|p| p.seq as usize == i).map(|p| p.row);
        let leader_row = row_of(leader);
        for (i, s) in req.seqs.iter().enumerate() {
            if s.is_finished() || s.num_computed != s.tokens.len() {
                continue;
            }
            let row = match row_of(i) {
                Some(r) => Some(r),
                None if forked_now => leader_row,
                None => None,
            };
            if let Some(row) = row {
                out.push_sample(row as usize, s.id, h, gen, i);
            }
        }
    }
}
