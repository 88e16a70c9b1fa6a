//! The steady-decode fast path: a single-sequence request decoding one token into a block it
//! owns alone is planned, recorded and registered without the general planner. Its rows are
//! written in place into the output's arrays, opened a chunk at a time (`DecodeRun`: no push
//! per row), and the blocks they fill are registered in the prefix cache in batches
//! (`DecodeBatch::flush`).
use crate::error::{Error, Result};
use crate::kv::KvCacheManager;

use crate::scheduler::output::{StepOutput, TableRow};
use crate::scheduler::state::store::{RequestStore, Slot};
use crate::scheduler::Scheduler;

/// Rows a fast-path run opens in the output at first, and at most, at a time. The chunks
/// double from the first: a run that stops early (a walk that meets a general-path request
/// every few rows) opened no more than a few times the rows it wrote.
const FIRST_CHUNK: usize = 8;
const MAX_CHUNK: usize = 256;

/// One row of a fast path (a plain decode here, a decode with drafts in
/// `features/spec/fast_path.rs`): its table row already in the output's layout (copied whole),
/// and what the other arrays take besides.
#[derive(Debug, Clone, Copy)]
pub(in crate::scheduler) struct DecodeRow {
    pub(in crate::scheduler) row: TableRow,
    pub(in crate::scheduler) seq_id: u64,
    pub(in crate::scheduler) gen: u32,
}

impl DecodeRow {
    /// Writes the row into its places in the output's arrays (`DecodeRun`): the table row,
    /// the sequence id and the generation.
    #[inline(always)]
    fn store(self, (row, seq_id, gen): (&mut TableRow, &mut i64, &mut u32)) {
        (*row, *seq_id, *gen) = (self.row, self.seq_id as i64, self.gen);
    }
}

/// Records queued rows of the draft fast path (`features/spec/fast_path.rs`: each the only
/// sequence of its request, sampling once, in queue order) into `out`: one tight loop per
/// output array instead of ~16 scattered pushes per row. Adds the rows' own tokens to
/// `num_batched_tokens` (the drafts are the caller's to add).
pub(in crate::scheduler) fn record_rows<'a>(
    out: &mut StepOutput,
    rows: impl ExactSizeIterator<Item = &'a DecodeRow> + Clone,
) {
    let base = out.seq_ids.len();
    out.seq_ids.extend(rows.clone().map(|r| r.seq_id as i64));
    out.gens.extend(rows.clone().map(|r| r.gen));
    out.seq_index.resize(out.seq_ids.len(), 0);
    out.num_tokens.extend(rows.clone().map(|r| r.row.n as i32));
    out.table_rows.extend(rows.map(|r| r.row));
    finish_rows(out, base);
}

/// Completes fast-path rows `base..` of `out` (single-sequence rows, sequence index 0),
/// whose table rows, sequence ids, generations, sequence indexes and token counts are in
/// place: copies each row's handle and start from its table row, and records one sample per
/// row, in row order (copies of the row arrays).
fn finish_rows(out: &mut StepOutput, base: usize) {
    let rows = &out.table_rows[base..];
    out.handles.extend(rows.iter().map(|r| r.handle));
    out.start_pos.extend(rows.iter().map(|r| r.start as i32));
    let end = out.seq_ids.len();
    out.num_batched_tokens += end - base;
    out.sample_rows.extend((base as i64)..(end as i64));
    out.sample_seq_ids.extend_from_slice(&out.seq_ids[base..]);
    out.sample_handles.extend_from_slice(&out.handles[base..]);
    out.sample_gens.extend_from_slice(&out.gens[base..]);
    let k = out.sample_seq_index.len();
    out.sample_seq_index.resize(k + (end - base), 0);
}

/// A chunk of plain fast-path decode rows opened in the output: the arrays are grown by
/// the chunk's length up front (every row's sequence index 0 and token count 1 already in
/// place), so the walk writes each row in place, with no push, capacity check or length
/// update per row, and only the arrays it cannot derive: `close` copies each row's handle and
/// start from its table row, keeps the rows written and records their samples.
struct DecodeRun<'a> {
    table_rows: &'a mut [TableRow],
    seq_ids: &'a mut [i64],
    gens: &'a mut [u32],
}

impl<'a> DecodeRun<'a> {
    /// Opens `n` rows at the end of `out`; returns the first one's index and the run.
    fn open(out: &'a mut StepOutput, n: usize) -> (usize, Self) {
        let base = out.seq_ids.len();
        let end = base + n;
        out.seq_index.resize(end, 0);
        out.num_tokens.resize(end, 1);
        out.seq_ids.resize(end, 0);
        out.gens.resize(end, 0);
        out.table_rows.resize(end, TableRow::default());
        let run = DecodeRun {
            table_rows: &mut out.table_rows[base..],
            seq_ids: &mut out.seq_ids[base..],
            gens: &mut out.gens[base..],
        };
        (base, run)
    }

    /// The run without its first row.
    fn skip_first(self) -> Self {
        DecodeRun {
            table_rows: &mut self.table_rows[1..],
            seq_ids: &mut self.seq_ids[1..],
            gens: &mut self.gens[1..],
        }
    }

    /// Keeps the first `written` rows opened at `base` (drops the rest) and completes them
    /// (`finish_rows`).
    fn close(out: &mut StepOutput, base: usize, written: usize) {
        let end = base + written;
        out.table_rows.truncate(end);
        out.seq_ids.truncate(end);
        out.gens.truncate(end);
        out.seq_index.truncate(end);
        out.num_tokens.truncate(end);
        finish_rows(out, base);
    }
}

/// Prefix-cache registrations of fast-path decodes, queued to be made in one batch.
#[derive(Debug, Default)]
pub(in crate::scheduler) struct DecodeBatch {
    /// (request slot, num_computed) of fast-path decodes that filled a block, registered in
    /// the prefix cache by `flush` (queue order).
    fills: Vec<(u32, u32)>,
}

impl DecodeBatch {
    /// Forgets queued registrations: left over only by a step that failed midway, and
    /// registering is optional caching.
    pub(super) fn drop_fills(&mut self) {
        self.fills.clear();
    }

    /// Registers the blocks filled by queued decodes (queue order), in one batch. Must run
    /// before anything else touches the prefix cache, to keep the registration order.
    pub(in crate::scheduler) fn flush(
        &mut self,
        store: &RequestStore,
        mgr: &mut KvCacheManager,
    ) -> Result<()> {
        if self.fills.is_empty() {
            return Ok(());
        }
        let items: Vec<_> = self
            .fills
            .iter()
            .map(|&(h, n)| {
                // Only the slot's hot lines: a fast-path sequence is its request's only one,
                // so its id is the request's first.
                let req = store.get(h);
                (
                    req.first_seq_id,
                    &req.seqs[0].tokens[..],
                    n as usize,
                    req.extra_key,
                )
            })
            .collect();
        mgr.cache_full_blocks_batch(&items)?;
        self.fills.clear();
        Ok(())
    }
}

/// The facts the fast path reads per sequence, read once per walk (kept in registers).
#[derive(Debug, Clone, Copy)]
pub(in crate::scheduler) struct FastDecode {
    pub(in crate::scheduler) block_size: usize,
    pub(in crate::scheduler) lookahead: usize,
    pub(in crate::scheduler) max_model_len: usize,
    pub(in crate::scheduler) caching: bool,
}

impl Scheduler {
    pub(super) fn fast_decode_facts(&self) -> FastDecode {
        FastDecode {
            block_size: self.mgr.block_size(),
            lookahead: self.cfg.num_lookahead_slots,
            max_model_len: self.cfg.max_model_len,
            caching: self.caching(),
        }
    }
}

/// Runs the fast path over `running` (the walk's `running[i..]`), at most `left` requests,
/// stopping at the first one it does not take (see `DecodeBatch::try_decode`): each row is
/// written into `out` in place, the blocks filled wait in `batch` for its next `flush`.
/// Returns how many requests it took. It takes only the parts it touches (the walk passes
/// the scheduler's fields separately), so the walk keeps its state in registers and no
/// other state (a feature's, the configuration beyond `facts`) reaches it unseen.
#[inline(never)]
pub(super) fn fast_decode_run(
    running: &[u32],
    left: usize,
    facts: FastDecode,
    store: &mut RequestStore,
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    out: &mut StepOutput,
) -> Result<usize> {
    let running = &running[..running.len().min(left)];
    let slots = store.slots_mut();
    let mut k = 0;
    let mut size = FIRST_CHUNK;
    while let Some(&h) = running.get(k) {
        // A chunk's first row is taken before the chunk is opened: a walk that meets a
        // general-path request at once leaves the output untouched.
        let first = match batch.try_decode::<true>(h, facts, slots, mgr)? {
            Some(r) => r,
            None => match batch.try_decode_cold(h, facts, slots, mgr)? {
                Some(r) => r,
                None => break,
            },
        };
        let rest = &running[k + 1..running.len().min(k + size)];
        let (base, run) = DecodeRun::open(out, 1 + rest.len());
        first.store((
            &mut run.table_rows[0],
            &mut run.seq_ids[0],
            &mut run.gens[0],
        ));
        let (written, walked) = write_run(rest, facts, slots, mgr, batch, run.skip_first());
        // Closed even on an error: the output's arrays stay of one length.
        DecodeRun::close(out, base, 1 + written);
        walked?;
        k += 1 + written;
        if written < rest.len() {
            break;
        }
        size = (size * 2).min(MAX_CHUNK);
    }
    Ok(k)
}

/// Writes the rows of `chunk` into `run` (row j for request j) while the fast path takes
/// them; stops at the first request it does not take. Returns how many it took.
#[inline(always)]
fn write_run(
    chunk: &[u32],
    facts: FastDecode,
    slots: &mut [Slot],
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    run: DecodeRun<'_>,
) -> (usize, Result<()>) {
    let dest = run
        .table_rows
        .iter_mut()
        .zip(run.seq_ids.iter_mut().zip(run.gens.iter_mut()));
    let mut written = 0;
    for (&h, (row, (seq_id, gen))) in chunk.iter().zip(dest) {
        // The cold retry takes the block opens (1 in block_size) and what the fast path
        // refuses: the hot loop has no call to keep its registers across. Each arm writes its
        // own row (a row merged from both would go through the stack).
        match batch.try_decode::<true>(h, facts, slots, mgr) {
            Ok(Some(r)) => r.store((row, seq_id, gen)),
            Ok(None) => match batch.try_decode_cold(h, facts, slots, mgr) {
                Ok(Some(r)) => r.store((row, seq_id, gen)),
                Ok(None) => break,
                Err(e) => return (written, Err(e)),
            },
            Err(e) => return (written, Err(e)),
        }
        written += 1;
    }
    (written, Ok(()))
}

impl DecodeBatch {
    /// `try_decode` that also opens blocks, out of line (see `fast_decode_run`).
    #[cold]
    #[inline(never)]
    fn try_decode_cold(
        &mut self,
        h: u32,
        facts: FastDecode,
        slots: &mut [Slot],
        mgr: &mut KvCacheManager,
    ) -> Result<Option<DecodeRow>> {
        self.try_decode::<false>(h, facts, slots, mgr)
    }

    /// The common case: a single-sequence request decoding one token into a block it
    /// already owns alone. Plans the token, queues the block it fills for registration (see
    /// `DecodeBatch::flush`) and returns its row; returns None (nothing done) for anything
    /// else. `NO_OPEN`: also returns None, with nothing done, for a token that would open a
    /// block.
    #[inline(always)]
    fn try_decode<const NO_OPEN: bool>(
        &mut self,
        h: u32,
        facts: FastDecode,
        slots: &mut [Slot],
        mgr: &mut KvCacheManager,
    ) -> Result<Option<DecodeRow>> {
        let (bs, la) = (facts.block_size, facts.lookahead);
        let slot = &mut slots[h as usize];
        let gen = slot.gen;
        let req = slot.req.as_mut().expect("queued slot holds a request");
        let Some(s) = req.seqs.single_mut() else {
            return Ok(None);
        };
        let start = s.num_computed;
        if s.tail_shared || s.tokens.len() != start + 1 || start + 1 > facts.max_model_len {
            return Ok(None);
        }
        if start + 1 + la > s.table.num_blocks() * bs {
            if NO_OPEN {
                return Ok(None);
            }
            // Also common (1 in block_size steps per sequence): the token opens a fresh
            // block. With no lookahead and a free block that is a plain append (nothing
            // shared is written, so no CoW); anything else takes the general path.
            // A hybrid table grows every group and its windows release blocks: general path.
            if la != 0
                || start != s.table.num_blocks() * bs
                || mgr.num_free_device_blocks() == 0
                || mgr.is_hybrid()
            {
                return Ok(None);
            }
            if !self.fills.is_empty() && mgr.num_uncached_free_device_blocks() == 0 {
                // This open evicts a cached block: queued registrations go first, as they
                // would have without batching.
                return Ok(None);
            }
            // Same as append_slots(start, start + 1) here: start is the table's capacity.
            let Some(block) = mgr.append_fresh_block(s.id)? else {
                return Err(Error::InvalidState(format!(
                    "request {}: no fresh block after the free-block check",
                    req.id
                )));
            };
            debug_assert!(mgr
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
        let row = DecodeRow {
            row: TableRow {
                handle: h,
                seq: 0,
                len: s.table.num_blocks() as u32,
                start: start as u32,
                n: 1,
                // tokens.len() == start + 1 was checked above, so this is tokens[start].
                token: s.last_token,
                slot: (block as usize * bs + offset) as i64,
            },
            // seqs[0]: its id is the request's first (read from the slot's hot line).
            seq_id: req.first_seq_id,
            gen,
        };
        s.num_computed = start + 1;
        if facts.caching && offset + 1 == bs {
            // Registered in batches by `flush` (same order, before anything else can touch
            // the prefix cache).
            self.fills.push((h, (start + 1) as u32));
        }
        Ok(Some(row))
    }
}

/// Registrations queued from outside the plain fast path (the draft fast path,
/// `features/spec/fast_path.rs`), so both register in the same batches.
impl DecodeBatch {
    /// Queues the registration of the block that request slot `h` (a single sequence)
    /// filled by computing up to `num_computed`.
    pub(in crate::scheduler) fn queue_fill(&mut self, h: u32, num_computed: usize) {
        self.fills.push((h, num_computed as u32));
    }

    /// Whether registrations are queued.
    pub(in crate::scheduler) fn has_fills(&self) -> bool {
        !self.fills.is_empty()
    }
}
