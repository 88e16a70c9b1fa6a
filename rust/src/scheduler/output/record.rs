//! The step recorder: rows of the general path (`record`; the fast path batches its own, see
//! `schedule/decode.rs`), the outputs' buffers reused across steps, and the lazy per-token
//! arrays and block tables: built on demand from the live state, and snapshotted for every
//! output still held elsewhere before the live state stops describing it.
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ids::{BlockId, SeqId};
use crate::kv::NULL_BLOCK;

use super::step_output::{SharedTables, StepOutput, TableRow};
use crate::scheduler::state::request::Sequence;
use crate::scheduler::state::store::RequestStore;
use crate::scheduler::{Scheduler, SchedulerConfig};

/// Records one scheduled sequence's row. The per-token arrays are built from it on access
/// (`Scheduler::input_ids` / `slot_mapping`, `StepOutput::positions`); a single-token row
/// keeps its token and slot inline.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(in crate::scheduler) fn record(
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

/// Outputs' buffers and the lazy tables of outputs still held by a caller.
#[derive(Debug, Default)]
pub(in crate::scheduler) struct Recorder {
    /// Outputs handed back by `recycle`, so steady steps allocate nothing.
    spare: Vec<StepOutput>,
    /// Sequences scheduled by the last step (sizes a fresh output).
    last_num_seqs: usize,
    /// Block tables of recent outputs not built yet; `materialize_pending` snapshots the ones
    /// still held by a caller before any table changes other than by appending.
    pending: Vec<SharedTables>,
}

impl Recorder {
    /// An empty output for step `step`: a recycled one, or a new one sized from the last step.
    pub(in crate::scheduler) fn next_output(
        &mut self,
        step: u64,
        cfg: &SchedulerConfig,
    ) -> StepOutput {
        if let Some(mut out) = self.spare.pop() {
            out.reset(step);
            return out;
        }
        // The first outputs of a run are sized for a full step (a prefill burst otherwise
        // regrows every array a few times); later ones from the last step.
        let seqs = if step <= 2 {
            let budget = cfg.max_num_batched_tokens.min(1 << 16);
            self.last_num_seqs.max(cfg.max_num_seqs.min(budget))
        } else {
            self.last_num_seqs
        };
        StepOutput::with_capacity(step, seqs)
    }

    /// Closes a scheduled output: its rows move into its lazy tables, which stay pending.
    pub(in crate::scheduler) fn seal(&mut self, out: &mut StepOutput) {
        self.pending.retain(|t| Arc::strong_count(t) > 1);
        self.pending.push(out.seal_tables());
        self.last_num_seqs = out.num_seqs();
    }

    /// Takes back an output the caller is done with; its buffers serve a later step.
    pub(in crate::scheduler) fn recycle(&mut self, mut out: StepOutput) {
        let t = &out.tables;
        self.pending.retain(|p| !Arc::ptr_eq(p, t));
        if self.spare.len() < 2 {
            out.reclaim_rows();
            self.spare.push(out);
        }
    }

    /// Snapshots the tables and token ids of every output still held elsewhere and not built
    /// yet: called before a sequence's table changes other than by appending (CoW,
    /// preemption, finish, release) or its tokens go away (release), after which the live
    /// state no longer describes those outputs.
    pub(in crate::scheduler) fn materialize_pending(&mut self, store: &RequestStore) {
        for p in self.pending.drain(..) {
            if Arc::strong_count(&p) < 2 {
                continue;
            }
            let mut t = p.lock().unwrap_or_else(|e| e.into_inner());
            if t.built.is_none() {
                t.built = Some(build_tables(store, &t.rows));
            }
            if t.input_ids.is_none() {
                let total = t.rows.iter().map(|r| r.n as usize).sum();
                t.input_ids = Some(build_input_ids(store, &t.rows, total));
            }
        }
    }
}

impl Scheduler {
    /// Takes back an output the caller is done with; its buffers serve a later step.
    pub fn recycle(&mut self, out: StepOutput) {
        self.recorder.recycle(out);
    }

    /// Block tables of `out` as they were when it was scheduled: [S * width] row-major,
    /// padded with 0, and the width (the widest row).
    pub fn block_tables(&self, out: &StepOutput) -> (Vec<BlockId>, usize) {
        let mut t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        if t.built.is_none() {
            let built = build_tables(&self.store, &t.rows);
            t.built = Some(built);
        }
        t.built.clone().expect("built above")
    }

    /// [T] token ids of `out`, batch order, handed to `f` (built on first access and kept).
    pub fn with_input_ids<R>(&self, out: &StepOutput, f: impl FnOnce(&[i64]) -> R) -> R {
        let mut t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        if t.input_ids.is_none() {
            let ids = build_input_ids(&self.store, &t.rows, out.num_batched_tokens);
            t.input_ids = Some(ids);
        }
        f(t.input_ids.as_deref().expect("built above"))
    }

    /// [T] token ids of `out`, batch order.
    pub fn input_ids(&self, out: &StepOutput) -> Vec<i64> {
        self.with_input_ids(out, <[i64]>::to_vec)
    }

    /// [T] KV slot of each token of `out` (block * block_size + offset), as scheduled.
    pub fn slot_mapping(&self, out: &StepOutput) -> Vec<i64> {
        let t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        build_slot_mapping(
            &self.store,
            &t.rows,
            t.built.as_ref(),
            self.mgr.block_size(),
            out.num_batched_tokens,
        )
    }
}

impl Scheduler {
    /// Every KV group's block tables of `out` (hybrid KV groups: what each group's layers
    /// read): [G * S * width] row-major, group by group, each row padded with 0 to `width`
    /// (the widest row of the step) and -1 where a sliding-window group released a block (the
    /// kernels never read one: it lies wholly behind the window of the row's first query).
    /// Read from the live KV tables (`check_group_read`).
    pub fn group_tables(&self, out: &StepOutput) -> Result<(Vec<i32>, usize)> {
        self.check_group_read(out)?;
        let t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        let width = t.rows.iter().map(|r| r.len).max().unwrap_or(0) as usize;
        let plane = t.rows.len() * width; // one group's [S, width]
        let mut tables = vec![0i32; self.mgr.num_groups() * plane];
        // row by row: one lookup of each sequence's table, every group's row copied from it
        for (i, (r, &seq)) in t.rows.iter().zip(&out.seq_ids).enumerate() {
            let table = self.mgr.table(seq as SeqId)?;
            for (g, row) in table.rows().enumerate() {
                let dst = &mut tables[g * plane + i * width..][..r.len as usize];
                for (d, &b) in dst.iter_mut().zip(row) {
                    *d = if b == NULL_BLOCK { -1 } else { b as i32 };
                }
            }
        }
        Ok((tables, width))
    }

    /// Every KV group's slot of each token of `out` (block * block_size + offset in the
    /// group's table): [G * T], group by group. Read from the live KV tables
    /// (`check_group_read`).
    pub fn group_slots(&self, out: &StepOutput) -> Result<Vec<i64>> {
        self.check_group_read(out)?;
        let t = out.tables.lock().unwrap_or_else(|e| e.into_inner());
        let (bs, total) = (self.mgr.block_size(), out.num_batched_tokens);
        let mut slots = vec![0i64; self.mgr.num_groups() * total];
        let mut at = 0; // the row's first token
        for (r, &seq) in t.rows.iter().zip(&out.seq_ids) {
            let (start, n) = (r.start as usize, r.n as usize);
            for (g, row) in self.mgr.table(seq as SeqId)?.rows().enumerate() {
                let dst = &mut slots[g * total + at..][..n];
                for (d, p) in dst.iter_mut().zip(start..) {
                    *d = (row[p / bs] as usize * bs + p % bs) as i64;
                }
            }
            at += n;
        }
        Ok(slots)
    }

    /// The group tables are read from the live KV tables, so only of a hybrid manager (a
    /// one-group full-attention one has `block_tables`) and only while `out` is the latest
    /// step and still open (neither applied nor discarded): then the live tables are the ones
    /// it was scheduled with.
    fn check_group_read(&self, out: &StepOutput) -> Result<()> {
        if !self.mgr.is_hybrid() {
            return Err(Error::InvalidState(
                "kv group tables: the cache has one full-attention group (read block_tables)"
                    .into(),
            ));
        }
        if !self.ledger.is_open(out.step) {
            return Err(Error::InvalidState(format!(
                "kv group tables of step {} are read from the live KV tables: only before \
                 update_from_output / discard_step of that step",
                out.step
            )));
        }
        Ok(())
    }
}

/// The live sequence a pending output's row names (released ones were snapshotted).
#[inline]
fn row_seq<'a>(store: &'a RequestStore, r: &TableRow) -> &'a Sequence {
    &store
        .try_get(r.handle)
        .expect("a pending output's request is live (released ones were snapshotted)")
        .seqs[r.seq as usize]
}

/// Lays out `rows` (each a prefix of a live sequence's table) as a padded matrix.
fn build_tables(store: &RequestStore, rows: &[TableRow]) -> (Vec<BlockId>, usize) {
    let width = rows.iter().map(|r| r.len).max().unwrap_or(0) as usize;
    let mut data = vec![0; rows.len() * width];
    for (dst, r) in data.chunks_exact_mut(width.max(1)).zip(rows) {
        let table = &row_seq(store, r).table;
        dst[..r.len as usize].copy_from_slice(&table[..r.len as usize]);
    }
    (data, width)
}

/// [total] token ids of `rows`: a decode row's is inline, a longer row's are a slice of its
/// sequence's (append-only) history.
fn build_input_ids(store: &RequestStore, rows: &[TableRow], total: usize) -> Vec<i64> {
    let mut v = Vec::with_capacity(total);
    for r in rows {
        if r.n == 1 {
            v.push(r.token as i64);
        } else {
            let (start, end) = (r.start as usize, (r.start + r.n) as usize);
            v.extend(
                row_seq(store, r).tokens[start..end]
                    .iter()
                    .map(|&t| t as i64),
            );
        }
    }
    v
}

/// [total] KV slots of `rows`: a decode row's is inline, a longer row's come from its table
/// (the snapshot `built` when there is one, else the live mirror's prefix).
fn build_slot_mapping(
    store: &RequestStore,
    rows: &[TableRow],
    built: Option<&(Vec<BlockId>, usize)>,
    bs: usize,
    total: usize,
) -> Vec<i64> {
    let mut v = Vec::with_capacity(total);
    for (i, r) in rows.iter().enumerate() {
        if r.n == 1 {
            v.push(r.slot);
            continue;
        }
        let table: &[BlockId] = match built {
            Some((data, w)) => &data[i * w..i * w + r.len as usize],
            None => &row_seq(store, r).table[..r.len as usize],
        };
        let (mut p, end) = (r.start as usize, (r.start + r.n) as usize);
        while p < end {
            let b = p / bs;
            let block_end = end.min((b + 1) * bs);
            let base = (table[b] as usize * bs) as i64 - (b * bs) as i64;
            v.extend(((p as i64)..(block_end as i64)).map(|q| base + q));
            p = block_end;
        }
    }
    v
}
