//! What one `schedule()` call hands the model runner, as flat arrays.
//!
//! Order of the data-movement lists for the runner: swap out, swap in, copy (CoW), then the
//! forward pass over `input_ids`.
use std::sync::{Arc, Mutex};

use crate::connector::ConnectorMeta;
use crate::ids::{BlockId, TokenId};

use crate::scheduler::FinishReason;

/// What the lazy per-token arrays of row r are built from: its block table is the first
/// `len` blocks of sequence `seq` of the request in slot `handle`, its tokens are that
/// sequence's tokens `start..start + n`. Tables only grow between the scheduler's rewrite
/// events (CoW of a tail block, preemption, finish, release) and token histories only grow
/// until release, so both stay valid until one happens. A single-token row (a decode) also
/// carries its token and KV slot, so decode steps build `input_ids` / `slot_mapping` from
/// this row alone, without touching the sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct TableRow {
    pub handle: u32,
    pub seq: u32,
    pub len: u32,
    pub start: u32,
    pub n: u32,
    /// The token when `n == 1`; for a row of one token then drafts (speculative decoding),
    /// that first token (else 0).
    pub token: u32,
    /// The KV slot when `n == 1` (else 0).
    pub slot: i64,
}

/// A step's block tables and per-token arrays, built on demand: copying every row's table
/// each step was the largest cost of a decode step, and recording every prompt token three
/// times (ids, positions, slots) that of a prefill burst; callers that never read them should
/// not pay it. The scheduler keeps a handle on the pending ones and fills `built` and
/// `input_ids` (snapshots) before any rewrite event, so the lazy results always equal the
/// values at schedule time. `slot_mapping` needs no snapshot of its own (it is derived from
/// the tables: the snapshot when there is one) and `positions` none at all (`start`, `n`).
#[derive(Debug, Default)]
pub struct LazyTables {
    pub rows: Vec<TableRow>,
    /// [S * width] row-major, padded with 0, and the width.
    pub built: Option<(Vec<BlockId>, usize)>,
    /// [T] token ids, once built.
    pub input_ids: Option<Vec<i64>>,
}

pub type SharedTables = Arc<Mutex<LazyTables>>;

/// One step of work. Per scheduled sequence (batch order, S of them) and per token (T).
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    pub step: u64,
    /// [S] sequence ids.
    pub seq_ids: Vec<i64>,
    /// [S] slot of the owning request in the scheduler, with the slot's generation at
    /// schedule time (ids are resolved lazily by the bindings).
    pub handles: Vec<u32>,
    pub gens: Vec<u32>,
    /// [S] index of the sequence within its request.
    pub seq_index: Vec<i32>,
    /// [S] tokens computed this step and the position of the first one.
    pub num_tokens: Vec<i32>,
    pub start_pos: Vec<i32>,
    /// [S] where each row's block table and tokens are, while the step is being built; then
    /// moved into `tables`. The [T] arrays (token ids, positions, KV slots, in batch order)
    /// are built from them on access: `Scheduler::input_ids`, `StepOutput::positions`,
    /// `Scheduler::slot_mapping`; the tables with `Scheduler::block_tables`.
    pub(crate) table_rows: Vec<TableRow>,
    pub(crate) tables: SharedTables,
    /// [K] samples to draw: logits row, receiving sequence, its request and index.
    pub sample_rows: Vec<i64>,
    pub sample_seq_ids: Vec<i64>,
    pub sample_handles: Vec<u32>,
    pub sample_gens: Vec<u32>,
    pub sample_seq_index: Vec<i32>,
    /// [C * 2], [O * 2], [I * 2] flattened block pairs.
    pub blocks_to_copy: Vec<i64>,
    pub blocks_to_swap_out: Vec<i64>,
    pub blocks_to_swap_in: Vec<i64>,
    /// Request ids preempted this step, in preemption order.
    pub preempted: Vec<String>,
    /// Requests finished at schedule time (ignored), with the reason.
    pub finished: Vec<(String, String)>,
    /// T, the tokens computed this step.
    pub num_batched_tokens: usize,
    /// What features beyond the core hand the model runner per row (see [`StepExtras`]).
    pub extras: StepExtras,
    /// A KV connector's loads and saves for the workers (`None` without one: boxed, so a
    /// scheduler without a connector moves no larger output; read it with `kv_meta()`).
    pub kv_meta: Option<Box<ConnectorMeta>>,
}

/// The place for per-row (or per-request) step data that features beyond the core add:
/// draft tokens to verify (speculative decoding), which rows sample under a grammar mask
/// (structured output), each row's adapter (LoRA).
///
/// A feature adds its columns here, fills them where a general-path row is recorded
/// (`record::record`, from `Request::extras`), and empties them in `clear` (called by
/// `StepOutput::reset` when an output is reused). Rows of the decode fast path carry no
/// extras: requests that need them must take the general path (see
/// `RequestExtras`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepExtras {
    /// [S] LoRA adapter of each row (0 = base model); empty while LoRA is off (`max_loras =
    /// 0`). Filled from the rows' requests when the step is sealed (`features/lora.rs`), so the
    /// decode fast path records nothing for it.
    pub lora_ids: Vec<i64>,
    /// [S] draft tokens scheduled after each row's own tokens (speculative decoding: the last
    /// `spec_num_draft_tokens[r]` of row r's `num_tokens` are drafts to verify); empty when the
    /// step schedules none. Filled when the step is sealed (`features/spec/record.rs`).
    pub spec_num_draft_tokens: Vec<i32>,
    /// [D] the draft tokens, row order (row r's run follows the runs of the rows before it).
    pub spec_draft_token_ids: Vec<i64>,
}

impl StepExtras {
    /// Empties every column, keeping its capacity.
    pub(crate) fn clear(&mut self) {
        self.lora_ids.clear();
        self.spec_num_draft_tokens.clear();
        self.spec_draft_token_ids.clear();
    }
}

impl StepOutput {
    /// [T] position of each token (row r's are `start_pos[r]..start_pos[r] + num_tokens[r]`).
    pub fn positions(&self) -> Vec<i64> {
        let mut v = Vec::with_capacity(self.num_batched_tokens);
        for (&s, &n) in self.start_pos.iter().zip(&self.num_tokens) {
            if n == 1 {
                v.push(s as i64);
            } else {
                v.extend((s as i64)..(s as i64 + n as i64));
            }
        }
        v
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_ids.len()
    }

    pub fn num_samples(&self) -> usize {
        self.sample_rows.len()
    }

    /// Every scheduled sequence computes exactly one token (false for an empty step).
    pub fn is_decode_only(&self) -> bool {
        !self.num_tokens.is_empty() && self.num_batched_tokens == self.num_tokens.len()
    }

    /// [S] context length after this step.
    pub fn seq_lens(&self) -> Vec<i32> {
        self.start_pos
            .iter()
            .zip(&self.num_tokens)
            .map(|(s, n)| s + n)
            .collect()
    }

    /// [S + 1] cumulative token counts.
    pub fn query_start_loc(&self) -> Vec<i32> {
        let mut v = Vec::with_capacity(self.num_tokens.len() + 1);
        let mut acc = 0i32;
        v.push(0);
        for n in &self.num_tokens {
            acc += n;
            v.push(acc);
        }
        v
    }

    /// Empties every array, keeping its capacity, for reuse as step `step`.
    pub(crate) fn reset(&mut self, step: u64) {
        self.step = step;
        self.seq_ids.clear();
        self.handles.clear();
        self.gens.clear();
        self.seq_index.clear();
        self.num_tokens.clear();
        self.start_pos.clear();
        self.table_rows.clear();
        self.sample_rows.clear();
        self.sample_seq_ids.clear();
        self.sample_handles.clear();
        self.sample_gens.clear();
        self.sample_seq_index.clear();
        self.blocks_to_copy.clear();
        self.blocks_to_swap_out.clear();
        self.blocks_to_swap_in.clear();
        self.preempted.clear();
        self.finished.clear();
        self.num_batched_tokens = 0;
        self.extras.clear();
        if let Some(meta) = &mut self.kv_meta {
            meta.clear();
        }
    }

    /// The KV connector's loads and saves (empty without a connector).
    pub fn kv_meta(&self) -> &ConnectorMeta {
        static EMPTY: ConnectorMeta = ConnectorMeta::EMPTY;
        self.kv_meta.as_deref().unwrap_or(&EMPTY)
    }

    /// Pre-size the per-sequence arrays from the previous step's size.
    pub(crate) fn with_capacity(step: u64, seqs: usize) -> Self {
        StepOutput {
            step,
            seq_ids: Vec::with_capacity(seqs),
            handles: Vec::with_capacity(seqs),
            gens: Vec::with_capacity(seqs),
            seq_index: Vec::with_capacity(seqs),
            num_tokens: Vec::with_capacity(seqs),
            table_rows: Vec::with_capacity(seqs),
            start_pos: Vec::with_capacity(seqs),
            sample_rows: Vec::with_capacity(seqs),
            sample_seq_ids: Vec::with_capacity(seqs),
            sample_handles: Vec::with_capacity(seqs),
            sample_gens: Vec::with_capacity(seqs),
            sample_seq_index: Vec::with_capacity(seqs),
            ..Default::default()
        }
    }

    /// Moves the rows into a fresh shared `tables` (the old one may still be held by the
    /// scheduler's pending list) and returns it.
    pub(crate) fn seal_tables(&mut self) -> SharedTables {
        let rows = std::mem::take(&mut self.table_rows);
        self.tables = Arc::new(Mutex::new(LazyTables {
            rows,
            built: None,
            input_ids: None,
        }));
        Arc::clone(&self.tables)
    }

    /// Takes the row buffer back from `tables` when nobody else holds it (buffer reuse).
    pub(crate) fn reclaim_rows(&mut self) {
        if let Some(t) = Arc::get_mut(&mut self.tables) {
            let t = t.get_mut().unwrap_or_else(|e| e.into_inner());
            if self.table_rows.capacity() < t.rows.capacity() {
                self.table_rows = std::mem::take(&mut t.rows);
                self.table_rows.clear();
            }
        }
    }

    /// Appends block pairs (source, destination) to one of the flattened [N * 2] lists
    /// (`blocks_to_copy`, `blocks_to_swap_out`, `blocks_to_swap_in`).
    pub(crate) fn push_pairs(list: &mut Vec<i64>, pairs: Vec<(BlockId, BlockId)>) {
        list.reserve(pairs.len() * 2);
        for (src, dst) in pairs {
            list.push(src as i64);
            list.push(dst as i64);
        }
    }

    pub(crate) fn push_sample(
        &mut self,
        row: usize,
        seq_id: u64,
        handle: u32,
        gen: u32,
        index: usize,
    ) {
        self.sample_rows.push(row as i64);
        self.sample_seq_ids.push(seq_id as i64);
        self.sample_handles.push(handle);
        self.sample_gens.push(gen);
        self.sample_seq_index.push(index as i32);
    }
}

/// A sequence that finished in `update_from_output`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSeq {
    pub request_id: String,
    pub seq_index: usize,
    pub reason: FinishReason,
    pub stop_reason: Option<TokenId>,
    /// The whole request is done (its last sequence finished).
    pub request_finished: bool,
}
