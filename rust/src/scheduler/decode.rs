//! The steady-decode fast path: a single-sequence request decoding one token into a block it
//! owns alone is planned, recorded and registered without the general planner. Its rows are
//! queued and recorded into the output in batches (`DecodeBatch::flush`: one tight loop per
//! output array instead of ~16 scattered pushes per sequence), and the blocks they fill are
//! registered in the prefix cache in batches too, at the same points.
use crate::error::{Error, Result};
use crate::kv::KvCacheManager;

use super::output::{StepOutput, TableRow};
use super::store::{RequestStore, Slot};
use super::Scheduler;

/// Fast-path decodes queued before `flush` records them (64 x 48 B stays in L1).
const DECODE_BATCH: usize = 64;

/// One row of a fast path (a plain decode here, a decode with drafts in `spec.rs`), as
/// `record_rows` records it: its table row already in the output's layout (copied whole),
/// and what the other arrays take besides.
#[derive(Debug, Clone, Copy)]
pub(super) struct DecodeRow {
    pub(super) row: TableRow,
    pub(super) seq_id: u64,
    pub(super) gen: u32,
}

/// Records queued fast-path rows (each the only sequence of its request, sampling once, in
/// queue order) into `out`: one tight loop per output array instead of ~16 scattered pushes
/// per row. `ONE_TOKEN`: every row computes one token (plain decode), so the token counts
/// are filled rather than read. Adds the rows' own tokens to `num_batched_tokens` (a
/// caller's drafts are its to add).
#[inline(always)]
pub(super) fn record_rows<'a, const ONE_TOKEN: bool>(
    out: &mut StepOutput,
    rows: impl ExactSizeIterator<Item = &'a DecodeRow> + Clone,
) {
    let n = rows.len();
    let base = out.seq_ids.len();
    out.seq_ids.extend(rows.clone().map(|r| r.seq_id as i64));
    out.handles.extend(rows.clone().map(|r| r.row.handle));
    out.gens.extend(rows.clone().map(|r| r.gen));
    out.seq_index.resize(base + n, 0);
    if ONE_TOKEN {
        out.num_tokens.resize(base + n, 1);
    } else {
        out.num_tokens.extend(rows.clone().map(|r| r.row.n as i32));
    }
    out.start_pos
        .extend(rows.clone().map(|r| r.row.start as i32));
    out.table_rows.extend(rows.map(|r| r.row));
    out.num_batched_tokens += n;
    out.sample_rows.extend((base as i64)..((base + n) as i64));
    out.sample_seq_ids.extend_from_slice(&out.seq_ids[base..]);
    out.sample_handles.extend_from_slice(&out.handles[base..]);
    out.sample_gens.extend_from_slice(&out.gens[base..]);
    let k = out.sample_seq_index.len();
    out.sample_seq_index.resize(k + n, 0);
}

/// Fast-path work queued but not yet in the output or the prefix cache.
#[derive(Debug, Default)]
pub(super) struct DecodeBatch {
    rows: Vec<DecodeRow>,
    /// (request slot, num_computed) of fast-path decodes that filled a block, registered in
    /// the prefix cache by `flush` (queue order).
    fills: Vec<(u32, u32)>,
}

impl DecodeBatch {
    /// Whether enough rows are queued to flush: a step's worth of rows would no longer fit
    /// in L1 between `flush`'s passes.
    #[inline]
    pub(super) fn is_full(&self) -> bool {
        self.rows.len() >= DECODE_BATCH
    }

    /// Forgets queued registrations: left over only by a step that failed midway, and
    /// registering is optional caching.
    pub(super) fn drop_fills(&mut self) {
        self.fills.clear();
    }

    /// Records the queued rows (rows and samples, in queue order) into `out` and registers
    /// the blocks they filled. Must run before anything else appends rows or samples, or
    /// touches the prefix cache, to keep the batch order.
    pub(super) fn flush(
        &mut self,
        out: &mut StepOutput,
        store: &RequestStore,
        mgr: &mut KvCacheManager,
    ) -> Result<()> {
        self.flush_rows(out);
        self.flush_fills(store, mgr)
    }

    fn flush_rows(&mut self, out: &mut StepOutput) {
        if !self.rows.is_empty() {
            record_rows::<true>(out, self.rows.iter());
            self.rows.clear();
        }
    }

    /// Registers the blocks filled by queued decodes (queue order), in one batch.
    fn flush_fills(&mut self, store: &RequestStore, mgr: &mut KvCacheManager) -> Result<()> {
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
pub(super) struct FastDecode {
    block_size: usize,
    lookahead: usize,
    max_model_len: usize,
    caching: bool,
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

    /// Runs the fast path over `running[i..]`, at most `left` requests, stopping at the
    /// first one it does not take (see `DecodeBatch::try_push`); flushes whenever the batch
    /// is full. Returns how many requests it took. Borrows the scheduler's parts separately
    /// so the walk keeps its state in registers.
    pub(super) fn fast_decode_run(
        &mut self,
        i: usize,
        left: usize,
        facts: FastDecode,
        out: &mut StepOutput,
    ) -> Result<usize> {
        let Scheduler {
            queues,
            store,
            mgr,
            batch,
            ..
        } = self;
        fast_decode_run(&queues.running[i..], left, facts, store, mgr, batch, out)
    }
}

/// See `Scheduler::fast_decode_run` (a free function: its borrows are disjoint parameters).
#[inline(never)]
fn fast_decode_run(
    running: &[u32],
    left: usize,
    facts: FastDecode,
    store: &mut RequestStore,
    mgr: &mut KvCacheManager,
    batch: &mut DecodeBatch,
    out: &mut StepOutput,
) -> Result<usize> {
    let running = &running[..running.len().min(left)];
    let mut k = 0;
    while k < running.len() {
        // A chunk that fits in the batch: no flush inside, so the slots stay a local slice.
        let chunk = &running[k..running.len().min(k + DECODE_BATCH - batch.rows.len())];
        let slots = store.slots_mut();
        for &h in chunk {
            // The cold retry takes the block opens (1 in block_size) and what the fast path
            // refuses: the hot loop has no call to keep its registers across.
            if !batch.try_push::<true>(h, facts, slots, mgr)?
                && !batch.try_push_cold(h, facts, slots, mgr)?
            {
                return Ok(k);
            }
            k += 1;
        }
        if batch.is_full() {
            // Rows only: the fills wait for the walk's next full flush (one registration
            // batch per run). Nothing in between touches the prefix cache: an open that
            // would evict a cached block leaves the fast path, which flushes first.
            batch.flush_rows(out);
        }
    }
    Ok(k)
}

impl DecodeBatch {
    /// `try_push` that also opens blocks, out of line (see `fast_decode_run`).
    #[cold]
    #[inline(never)]
    fn try_push_cold(
        &mut self,
        h: u32,
        facts: FastDecode,
        slots: &mut [Slot],
        mgr: &mut KvCacheManager,
    ) -> Result<bool> {
        self.try_push::<false>(h, facts, slots, mgr)
    }

    /// The common case: a single-sequence request decoding one token into a block it
    /// already owns alone. Queues the row (see `DecodeBatch::flush`); returns false (nothing
    /// done) for anything else. `NO_OPEN`: also returns false, with nothing done, for a
    /// token that would open a block.
    #[inline(always)]
    fn try_push<const NO_OPEN: bool>(
        &mut self,
        h: u32,
        facts: FastDecode,
        slots: &mut [Slot],
        mgr: &mut KvCacheManager,
    ) -> Result<bool> {
        let (bs, la) = (facts.block_size, facts.lookahead);
        let slot = &mut slots[h as usize];
        let gen = slot.gen;
        let req = slot.req.as_mut().expect("queued slot holds a request");
        let Some(s) = req.seqs.single_mut() else {
            return Ok(false);
        };
        let start = s.num_computed;
        if s.tail_shared || s.tokens.len() != start + 1 || start + 1 > facts.max_model_len {
            return Ok(false);
        }
        if start + 1 + la > s.table.num_blocks() * bs {
            if NO_OPEN {
                return Ok(false);
            }
            // Also common (1 in block_size steps per sequence): the token opens a fresh
            // block. With no lookahead and a free block that is a plain append (nothing
            // shared is written, so no CoW); anything else takes the general path.
            if la != 0 || start != s.table.num_blocks() * bs || mgr.num_free_device_blocks() == 0 {
                return Ok(false);
            }
            if !self.fills.is_empty() && mgr.num_uncached_free_device_blocks() == 0 {
                // This open evicts a cached block: queued registrations go first, as they
                // would have without batching.
                return Ok(false);
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
        self.rows.push(DecodeRow {
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
        });
        s.num_computed = start + 1;
        if facts.caching && offset + 1 == bs {
            // Registered in batches by `flush` (same order, before anything else can touch
            // the prefix cache).
            self.fills.push((h, (start + 1) as u32));
        }
        Ok(true)
    }
}

/// Registrations queued from outside the plain fast path (the draft fast path, `spec.rs`),
/// so both register in the same batches.
impl DecodeBatch {
    /// Queues the registration of the block that request slot `h` (a single sequence)
    /// filled by computing up to `num_computed`.
    pub(super) fn queue_fill(&mut self, h: u32, num_computed: usize) {
        self.fills.push((h, num_computed as u32));
    }

    /// Whether registrations are queued.
    pub(super) fn has_fills(&self) -> bool {
        !self.fills.is_empty()
    }
}
