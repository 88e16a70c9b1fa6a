//! The draft fast path: in a step with drafts, a single-sequence request decoding into
//! blocks it owns alone, whose run (its token, then its drafts) fits its table or one fresh
//! block, is queued, recorded in batches and its filled blocks registered in the plain decode
//! fast path's batches (`schedule/decode.rs`), without the general planner.
use crate::error::Result;
use crate::kv::KvCacheManager;
use crate::scheduler::output::{StepOutput, TableRow};
use crate::scheduler::schedule::decode::{record_rows, DecodeBatch, DecodeRow, FastDecode};
use crate::scheduler::state::store::{RequestStore, Slot};

use super::SpecState;

/// A fast-path row of a step with drafts, as `SpecState::flush_rows` records it: its table
/// row in the output's layout (its own token inline), and how many drafts follow it (their
/// tokens are queued as stretches, `SpecState::stretches`).
#[derive(Debug, Clone, Copy)]
pub(super) struct SpecRow {
    decode: DecodeRow,
    drafts: u32,
}

/// Fast-path rows queued before `flush_rows` records them (the rows stay in L1 between the
/// flush's passes).
const SPEC_BATCH: usize = 64;

impl SpecState {
    /// Queues the `count` drafts from `offset` of a fast-path row.
    #[inline(always)]
    fn queue_drafts(&mut self, offset: u32, count: u32) {
        self.queued_drafts += count as usize;
        match self.stretches.last_mut() {
            Some(last) if last.1 == offset => last.1 += count,
            _ => self.stretches.push((offset, offset + count)),
        }
    }

    /// Records the queued fast-path rows (rows, samples, draft columns; queue order) into
    /// `out`: one tight loop per output array.
    fn flush_rows(&mut self, out: &mut StepOutput) {
        let rows = &self.rows;
        if rows.is_empty() {
            return;
        }
        let base = out.seq_ids.len();
        record_rows(out, rows.iter().map(|r| &r.decode));
        out.num_batched_tokens += self.queued_drafts;
        if self.queued_drafts > 0 {
            let col = &mut out.extras.spec_num_draft_tokens;
            col.resize(base, 0);
            col.extend(rows.iter().map(|r| r.drafts as i32));
            let ids = &mut out.extras.spec_draft_token_ids;
            for &(from, to) in &self.stretches {
                ids.extend(
                    self.tokens[from as usize..to as usize]
                        .iter()
                        .map(|&t| t as i64),
                );
            }
            self.stretches.clear();
            self.queued_drafts = 0;
        }
        self.rows.clear();
    }
}

/// The fast path of a step with drafts, over `running` (the walk's `running[i..]`) within
/// `left` tokens: a single-sequence request decoding into blocks it owns alone, whose run
/// (its token, then its drafts, trimmed to the budget and the model length) fits its table
/// or one fresh block, is queued, recorded in batches and registered in batches (the block
/// fills with the plain decode fast path's, `schedule/decode.rs`) without the general
/// planner. Stops at the first request it does not take (the general path plans that one);
/// its rows are in `out` when it returns. Returns (requests taken, tokens used). Off with
/// lookahead slots (the V0 strategies' drafts ride in them: the general path). Like the plain
/// fast path it takes only the parts it touches, from the walk's `facts` on.
#[allow(clippy::too_many_arguments)]
pub(in crate::scheduler) fn spec_fast_run(
    running: &[u32],
    left: usize,
    facts: FastDecode,
    store: &mut RequestStore,
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    spec: &mut SpecState,
    out: &mut StepOutput,
) -> Result<(usize, usize)> {
    if facts.lookahead != 0 {
        return Ok((0, 0));
    }
    let taken = draft_walk(running, left, facts, store, mgr, batch, spec, out);
    spec.flush_rows(out);
    taken
}

/// One request's turn in the draft fast path.
enum SpecTurn {
    /// Queued: the tokens it takes.
    Taken(usize),
    /// Not for the fast path: the walk stops here.
    Refused,
    /// Its fresh block would evict a cached one while registrations are queued: they go
    /// first (as they would have unbatched), then it is tried again.
    FlushFirst,
}

/// The walk of `spec_fast_run`: queues the rows it takes, recording them by `SPEC_BATCH`.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn draft_walk(
    running: &[u32],
    mut left: usize,
    facts: FastDecode,
    store: &mut RequestStore,
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    spec: &mut SpecState,
    out: &mut StepOutput,
) -> Result<(usize, usize)> {
    let budget = left;
    let mut k = 0;
    while let Some(&h) = running.get(k) {
        if left == 0 {
            break;
        }
        match spec_turn(h, left, facts, store.slots_mut(), mgr, batch, spec)? {
            SpecTurn::Taken(used) => {
                left -= used;
                k += 1;
                if spec.rows.len() >= SPEC_BATCH {
                    spec.flush_rows(out);
                }
            }
            SpecTurn::Refused => break,
            SpecTurn::FlushFirst => batch.flush(store, mgr)?,
        }
    }
    Ok((k, budget - left))
}

/// Queues request `h`'s row (its token and up to `left - 1` of its drafts) if the fast path
/// takes it (see `spec_fast_run`); nothing changes otherwise.
#[inline(always)]
fn spec_turn(
    h: u32,
    left: usize,
    facts: FastDecode,
    slots: &mut [Slot],
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    spec: &mut SpecState,
) -> Result<SpecTurn> {
    let bs = facts.block_size;
    let slot = &mut slots[h as usize];
    let gen = slot.gen;
    let req = slot.req.as_mut().expect("queued slot holds a request");
    let Some(s) = req.seqs.single_mut() else {
        return Ok(SpecTurn::Refused);
    };
    let start = s.num_computed;
    if s.tail_shared || s.tokens.len() != start + 1 || start >= facts.max_model_len {
        return Ok(SpecTurn::Refused);
    }
    let (offset, pending) = spec.single_run(h, s.id);
    let d = (pending as usize)
        .min(left - 1)
        .min(facts.max_model_len - start - 1);
    // Capacities, not block counts: no division on this path (as `schedule/decode.rs`).
    let cap = s.table.num_blocks() * bs;
    let end = start + 1 + d;
    if end > cap {
        // One fresh block past a table that covers `start`: nothing shared is written.
        if end > cap + bs || start > cap || mgr.num_free_device_blocks() == 0 || mgr.is_hybrid() {
            return Ok(SpecTurn::Refused);
        }
        if batch.has_fills() && mgr.num_uncached_free_device_blocks() == 0 {
            return Ok(SpecTurn::FlushFirst);
        }
        let Some(block) = mgr.append_fresh_block(s.id)? else {
            return Ok(SpecTurn::Refused);
        };
        s.table.push(block);
    }
    // `start` fills its block when it is the last slot of the table before any fresh block
    // (the common cases; any other position is told by a division).
    let fills = if start < cap && start + bs >= cap {
        start + 1 == cap
    } else {
        (start + 1) % bs == 0
    };
    // A row without drafts is a plain decode row: its KV slot inline too (`start` is in
    // the last block, unless lookahead-free tables ever run longer).
    let slot = if d > 0 {
        0
    } else {
        let tail_start = (s.table.num_blocks() - 1) * bs;
        if start >= tail_start {
            (s.table.last_block() as usize * bs + start - tail_start) as i64
        } else {
            (s.table[start / bs] as usize * bs + start % bs) as i64
        }
    };
    spec.rows.push(SpecRow {
        decode: DecodeRow {
            row: TableRow {
                handle: h,
                seq: 0,
                len: s.table.num_blocks() as u32,
                start: start as u32,
                n: 1 + d as u32,
                // tokens.len() == start + 1 was checked above, so this is tokens[start].
                token: s.last_token,
                slot,
            },
            seq_id: s.id,
            gen,
        },
        drafts: d as u32,
    });
    if d > 0 {
        spec.queue_drafts(offset, d as u32);
    }
    s.num_computed = start + 1;
    if facts.caching && fills {
        // Registered in batches with the plain path's (`DecodeBatch::flush`).
        batch.queue_fill(h, start + 1);
    }
    Ok(SpecTurn::Taken(1 + d))
}
