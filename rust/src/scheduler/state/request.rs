//! Requests and their sequences: the per-request state the scheduler keeps in its store.
//!
//! [`Request`] and [`Sequence`] are laid out for the decode step (hot fields first, see their
//! docs). State that upcoming features add to a request goes into [`RequestExtras`], after the
//! hot fields, so a feature never moves them.
use crate::ids::{BlockId, SeqId, TokenId};
use crate::kv::salted_key;

use crate::scheduler::{FinishReason, StopParams};

/// Lifecycle of a request.
///
/// `repr(u64)`: its 2^64 - 8 unused values are the largest niche in [`Request`] (a `Vec`'s
/// capacity has 2^63), so an empty store slot (`Option<Request>::None`) is told by this field,
/// in the slot's hot line, rather than by a cold `Vec` capacity further down: the decode step
/// checks the slot without loading another cache line (unit test
/// `slot_generation_and_hot_request_fields_share_a_line`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u64)]
pub enum RequestStatus {
    Waiting,
    /// In `waiting` with device blocks allocated while a KV connector loads its prefix
    /// (`features/connector.rs`); admission steps over it until the load is reported.
    WaitingForRemoteKvs,
    Running,
    Swapped,
    /// Preempted by recompute: back in `waiting`, its generated tokens kept.
    Preempted,
    FinishedStopped,
    FinishedLengthCapped,
    FinishedAborted,
    FinishedIgnored,
}

impl RequestStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Waiting => "WAITING",
            RequestStatus::WaitingForRemoteKvs => "WAITING_FOR_REMOTE_KVS",
            RequestStatus::Running => "RUNNING",
            RequestStatus::Swapped => "SWAPPED",
            RequestStatus::Preempted => "PREEMPTED",
            RequestStatus::FinishedStopped => "FINISHED_STOPPED",
            RequestStatus::FinishedLengthCapped => "FINISHED_LENGTH_CAPPED",
            RequestStatus::FinishedAborted => "FINISHED_ABORTED",
            RequestStatus::FinishedIgnored => "FINISHED_IGNORED",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RequestStatus::FinishedStopped
                | RequestStatus::FinishedLengthCapped
                | RequestStatus::FinishedAborted
                | RequestStatus::FinishedIgnored
        )
    }

    /// Statuses a request sitting in `waiting` may have.
    pub fn is_waiting(self) -> bool {
        matches!(
            self,
            RequestStatus::Waiting | RequestStatus::WaitingForRemoteKvs | RequestStatus::Preempted
        )
    }
}

/// Everything `add_request` takes besides the id.
#[derive(Debug, Clone)]
pub struct RequestParams {
    pub prompt: Vec<TokenId>,
    pub n: usize,
    pub priority: i64,
    pub arrival_time: f64,
    pub stop: StopParams,
    /// Mixed into prefix-cache hashes (e.g. an adapter id).
    pub extra_key: u64,
    /// The LoRA adapter the request runs with (0 = the base model); see `features/lora.rs`.
    pub lora_id: u64,
    /// Structured output: the request samples under a grammar, which is being compiled when
    /// it is added; it waits (letting others pass) until `Scheduler::grammar_ready`.
    pub structured_output: bool,
}

/// One sample stream of a request (`n` of them per request).
///
/// Layout (`repr(C)`): everything a decode step reads or writes per sequence (the token
/// vector's header, `num_computed`, `finished`, `last_token`, `tail_shared` and the table's
/// last block and length) comes first, in 64 bytes; the table's allocation header and the id
/// follow. A single sequence sits inline in its request, right after the request's hot
/// fields (see [`Seqs`]); unit test `hot_fields_share_a_cache_line` checks the offsets.
#[derive(Debug, Clone)]
#[repr(C)]
pub struct Sequence {
    /// Prompt followed by this sequence's generated tokens.
    pub tokens: Vec<TokenId>,
    /// Tokens whose K/V are in the cache (or scheduled to be, this step).
    pub num_computed: usize,
    pub finished: Option<(FinishReason, Option<TokenId>)>,
    /// Copy of `tokens.last()` next to the other hot fields: the decode fast path reads it
    /// instead of the tail of `tokens` (a cache miss per sequence per step).
    pub last_token: TokenId,
    /// Blocks past `num_computed / block_size` may be shared with a sibling (set by a fork,
    /// cleared by the first append): the next append must go through the manager for CoW.
    pub tail_shared: bool,
    /// Mirror of the manager's device block table, so the hot path never asks the manager
    /// for it. Empty while the sequence holds no device blocks.
    pub table: MirrorTable,
    pub id: SeqId,
}

/// A block table mirror that also keeps its last block and its length in front of the
/// allocation header (inside the sequence's hot cache line, see [`Sequence`]): a decode step
/// writes into the last block and only needs the length to know whether it opens a new one.
/// Read-only as a slice; every change goes through `set` / `push` / `clear`, which keep
/// `last` and `len` in sync.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[repr(C)]
pub struct MirrorTable {
    last: BlockId,
    len: u32,
    blocks: Vec<BlockId>,
}

impl MirrorTable {
    pub fn set(&mut self, blocks: &[BlockId]) {
        self.blocks.clear();
        self.blocks.extend_from_slice(blocks);
        self.last = blocks.last().copied().unwrap_or(0);
        self.len = blocks.len() as u32;
    }

    /// Appends one block (a table that only grew by a fresh block: no copy of the rest).
    pub fn push(&mut self, block: BlockId) {
        self.blocks.push(block);
        self.last = block;
        self.len += 1;
    }

    pub fn clear(&mut self) {
        self.blocks.clear();
        self.last = 0;
        self.len = 0;
    }

    /// Keeps the first `len` blocks (the manager released the rest).
    pub fn truncate(&mut self, len: usize) {
        self.blocks.truncate(len);
        self.last = self.blocks.last().copied().unwrap_or(0);
        self.len = self.blocks.len() as u32;
    }

    /// The last block (0 when empty).
    #[inline]
    pub fn last_block(&self) -> BlockId {
        self.last
    }

    /// Number of blocks, read from the inline copy (no access to the allocation header).
    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.len as usize
    }

    pub fn as_slice(&self) -> &[BlockId] {
        &self.blocks
    }
}

impl std::ops::Deref for MirrorTable {
    type Target = [BlockId];
    fn deref(&self) -> &[BlockId] {
        &self.blocks
    }
}

impl Sequence {
    pub fn is_finished(&self) -> bool {
        self.finished.is_some()
    }

    /// Forgets what was computed (its blocks are given back by the caller): the sequence
    /// will be computed again from its tokens.
    pub fn reset_progress(&mut self) {
        self.num_computed = 0;
        self.table.clear();
        self.tail_shared = false;
    }
}

/// A request's sequences: a single one inline (the common `n = 1`), or `n > 1` in their own
/// allocation. Reads as a slice either way.
///
/// Inline, the sequence's hot fields follow the request's, so in the scheduler's store a
/// single-sequence request's whole decode state (slot generation, request and sequence hot
/// fields) is the slot's first 128 bytes, at an address computed from the slot index alone:
/// the decode step streams it without loading a pointer to the sequences first (a dependent
/// cache miss per sequence per step with a separate allocation). `repr(u8)`: a one-byte tag,
/// then the sequence at a fixed offset (unit test `hot_fields_share_a_cache_line`).
#[derive(Debug, Clone)]
#[repr(u8)]
pub enum Seqs {
    One(Sequence),
    Many(Vec<Sequence>),
}

impl Seqs {
    /// The sequence of a single-sequence request (None when `n > 1`).
    #[inline(always)]
    pub fn single_mut(&mut self) -> Option<&mut Sequence> {
        match self {
            Seqs::One(s) => Some(s),
            Seqs::Many(_) => None,
        }
    }
}

impl FromIterator<Sequence> for Seqs {
    fn from_iter<I: IntoIterator<Item = Sequence>>(iter: I) -> Self {
        let mut v: Vec<Sequence> = iter.into_iter().collect();
        if v.len() == 1 {
            Seqs::One(v.pop().expect("one sequence"))
        } else {
            Seqs::Many(v)
        }
    }
}

impl std::ops::Deref for Seqs {
    type Target = [Sequence];
    #[inline(always)]
    fn deref(&self) -> &[Sequence] {
        match self {
            Seqs::One(s) => std::slice::from_ref(s),
            Seqs::Many(v) => v,
        }
    }
}

impl<'a> IntoIterator for &'a Seqs {
    type Item = &'a Sequence;
    type IntoIter = std::slice::Iter<'a, Sequence>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a> IntoIterator for &'a mut Seqs {
    type Item = &'a mut Sequence;
    type IntoIter = std::slice::IterMut<'a, Sequence>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

impl std::ops::DerefMut for Seqs {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [Sequence] {
        match self {
            Seqs::One(s) => std::slice::from_mut(s),
            Seqs::Many(v) => v,
        }
    }
}

/// A request: one prompt and `n` sequences sampled from it.
///
/// Layout (`repr(C)`): the fields a decode step reads (`status`, `quiet_until`,
/// `extra_key` for the blocks it fills, `first_seq_id`) come first, then the sequences (a single one inline, its
/// hot fields next), so that with the scheduler's slot generation in front a
/// single-sequence request's decode state is the slot's first 128 bytes (unit test
/// `hot_fields_share_a_cache_line`).
#[derive(Debug, Clone)]
#[repr(C)]
pub struct Request {
    pub status: RequestStatus,
    /// Whether the unfinished non-leader sequences currently exist in the manager. Before
    /// that only the leader (first unfinished sequence) holds blocks and computes the prompt.
    pub forked: bool,
    /// Sequence length below which no stop rule can fire (see `StopParams::quiet_until`):
    /// `update_from_output` skips the full check for a sampled token below it.
    pub quiet_until: usize,
    /// Prefix-cache hash key of the request's blocks (salted with its adapter).
    pub extra_key: u64,
    /// Id of `seqs[0]` (sequence ids of a request are consecutive: `seqs[i].id` is
    /// `first_seq_id + i`).
    pub first_seq_id: SeqId,
    /// The sequences (see [`Seqs`]).
    pub seqs: Seqs,
    pub id: String,
    pub num_unfinished: usize,
    pub priority: i64,
    pub arrival_time: f64,
    /// Insertion counter: breaks ties between equal (priority, arrival).
    pub order: u64,
    pub stop: StopParams,
    /// Read by the stop rules only once `quiet_until` is reached.
    pub prompt_len: usize,
    /// Prompt tokens served by the prefix cache at the first admission.
    pub num_cached_tokens: usize,
    pub admitted_once: bool,
    /// What features beyond the core keep per request (see [`RequestExtras`]).
    pub extras: RequestExtras,
}

/// The place for per-request state that features beyond the core add: speculative
/// decoding's draft tokens, structured output's grammar state (e.g. "waiting for its grammar
/// to compile"), a LoRA adapter id.
///
/// How a feature uses it:
/// - add its fields here, filled from `RequestParams` in [`RequestExtras::new`] (the one
///   place that reads a feature's request parameters);
/// - make admission wait on it with a condition in `schedule::admission::conditions` (every
///   strategy's admission path, swap-ins and the `priority` probe read that one function);
/// - hand per-row data to the model runner through `StepOutput::extras`, recorded where a
///   general-path row is recorded (`output::record::record`). The decode fast path
///   (`schedule::decode::fast_decode_run`) reads only the request's hot cache line: a feature
///   whose requests need more than one token per decode row (draft tokens) must send them to
///   the general path with a hot flag, not by reading this cold struct per sequence.
///
/// It sits after every hot field of [`Request`], so adding to it costs the decode step
/// nothing (unit test `hot_fields_share_a_cache_line`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    /// The LoRA adapter (0 = the base model): counted against `max_loras` by admission and
    /// reported per row in `StepExtras::lora_ids` (see `features/lora.rs`).
    pub lora_id: u64,
    /// Structured output: whether the request samples under a grammar and whether that
    /// grammar is compiled yet (see `features/grammar.rs`).
    pub grammar: GrammarState,
    /// KV connector: the transfer loading its prefix while it waits for remote KV (0: none).
    pub remote_job: u64,
    /// KV connector: prompt tokens the connector loaded for it before its first admission,
    /// capped there at `Request::num_cached_tokens` (of which they are a part).
    pub num_external_tokens: usize,
    /// Test-only stand-in for a feature's admission state: what
    /// `schedule::admission::conditions` answers for this request (unit tests of the seam).
    #[cfg(test)]
    pub(in crate::scheduler) condition: Option<crate::scheduler::schedule::admission::Verdict>,
}

impl RequestExtras {
    /// The extras of a new request, from its parameters.
    #[allow(
        clippy::needless_update,
        reason = "test builds have more fields, and so will features"
    )]
    pub(in crate::scheduler) fn new(params: &RequestParams) -> Self {
        RequestExtras {
            lora_id: params.lora_id,
            grammar: if params.structured_output {
                GrammarState::Compiling
            } else {
                GrammarState::Unconstrained
            },
            ..RequestExtras::default()
        }
    }
}

/// A request's grammar, for structured output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GrammarState {
    /// Samples freely.
    #[default]
    Unconstrained,
    /// Its grammar is being compiled: admission steps over it (it keeps its place).
    Compiling,
    /// Compiled: schedulable, and its samples are drawn under the grammar's mask.
    Ready,
}

impl Request {
    /// A new waiting request with `params.n` sequences of its prompt (ids `first_seq_id..`),
    /// inserted `order`-th. `max_model_len` sizes the token vectors' first growth,
    /// `max_seq_len` is the longest sequence the configuration holds (for the stop rules).
    ///
    /// Takes the stop rules out of `params` and copies the prompt: the caller frees the
    /// prompt after the request is placed in the store. Freeing it before lets the allocator
    /// put the next requests' hot state into its hole, which measured ~20% slower steady
    /// decode steps at 4096 running requests.
    pub(in crate::scheduler) fn new(
        id: &str,
        params: &mut RequestParams,
        first_seq_id: SeqId,
        order: u64,
        max_model_len: usize,
        max_seq_len: usize,
    ) -> Request {
        let prompt_len = params.prompt.len();
        // Room for the first outputs up front: appending the first sampled token to a
        // prompt-sized vector would copy the whole prompt.
        let room = params
            .stop
            .max_tokens
            .min(max_model_len.saturating_sub(prompt_len))
            .min(256);
        let seqs = (0..params.n)
            .map(|i| {
                let mut tokens = Vec::with_capacity(prompt_len + room);
                tokens.extend_from_slice(&params.prompt);
                Sequence {
                    id: first_seq_id + i as SeqId,
                    last_token: *tokens.last().expect("prompt is not empty"),
                    tokens,
                    num_computed: 0,
                    table: MirrorTable::default(),
                    tail_shared: false,
                    finished: None,
                }
            })
            .collect();
        Request {
            first_seq_id,
            id: id.to_string(),
            quiet_until: params.stop.quiet_until(prompt_len, max_seq_len),
            prompt_len,
            num_unfinished: params.n,
            seqs,
            forked: false,
            priority: params.priority,
            arrival_time: params.arrival_time,
            order,
            extras: RequestExtras::new(params),
            stop: std::mem::take(&mut params.stop),
            // The same tokens under different adapters have different K/V: never share blocks.
            extra_key: salted_key(params.extra_key, params.lora_id),
            status: RequestStatus::Waiting,
            num_cached_tokens: 0,
            admitted_once: false,
        }
    }

    /// Index of the sequence that computes the shared prompt.
    pub fn leader(&self) -> usize {
        self.seqs.iter().position(|s| !s.is_finished()).unwrap_or(0)
    }

    /// Whether the prompt still has to be computed once and then forked to siblings.
    pub fn needs_fork(&self) -> bool {
        !self.forked && self.num_unfinished > 1
    }

    /// Token count the leader computes before siblings exist: only the prompt when it will
    /// be forked, else all its tokens.
    pub fn leader_target(&self) -> usize {
        if self.needs_fork() {
            self.prompt_len
        } else {
            self.seqs[self.leader()].tokens.len()
        }
    }

    /// Whether sequence `i` holds (or is about to hold) blocks: the leader before the fork,
    /// every unfinished sequence after it.
    fn activity(&self) -> impl Fn(usize, &Sequence) -> bool {
        let (leader, forked) = (self.leader(), self.forked);
        move |i, s| !s.is_finished() && (forked || i == leader)
    }

    /// Indices of the active sequences (see `activity`).
    pub fn active_seqs(&self) -> impl Iterator<Item = usize> + '_ {
        let active = self.activity();
        self.seqs
            .iter()
            .enumerate()
            .filter(move |(i, s)| active(*i, s))
            .map(|(i, _)| i)
    }

    /// The active sequences (see `activity`).
    pub fn active_seqs_mut(&mut self) -> impl Iterator<Item = &mut Sequence> + '_ {
        let active = self.activity();
        self.seqs
            .iter_mut()
            .enumerate()
            .filter(move |(i, s)| active(*i, s))
            .map(|(_, s)| s)
    }

    /// Seats (`max_num_seqs`) the request occupies while running.
    pub fn seats(&self) -> usize {
        self.num_unfinished
    }

    /// Rank under `priority`: lower is more urgent.
    pub fn rank(&self) -> (i64, f64, u64) {
        (self.priority, self.arrival_time, self.order)
    }

    /// Whether next step this request only decodes (every active sequence needs at most
    /// one token once the samples of this step are appended).
    pub fn is_decoding(&self) -> bool {
        if self.needs_fork() {
            return false;
        }
        self.active_seqs().all(|i| {
            let s = &self.seqs[i];
            s.tokens.len() <= s.num_computed + 1
        })
    }
}

/// Total order of requests by rank (priority, arrival, insertion).
pub fn rank_less(a: (i64, f64, u64), b: (i64, f64, u64)) -> bool {
    match a.0.cmp(&b.0) {
        std::cmp::Ordering::Less => true,
        std::cmp::Ordering::Greater => false,
        std::cmp::Ordering::Equal => match a.1.partial_cmp(&b.1) {
            Some(std::cmp::Ordering::Less) => true,
            Some(std::cmp::Ordering::Greater) => false,
            _ => a.2 < b.2,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_fields_share_a_cache_line() {
        use std::mem::{offset_of, size_of};
        let table = offset_of!(Sequence, table);
        let seq_hot_end = [
            offset_of!(Sequence, tokens) + size_of::<Vec<TokenId>>(),
            offset_of!(Sequence, num_computed) + 8,
            offset_of!(Sequence, finished) + size_of::<Option<(FinishReason, Option<TokenId>)>>(),
            offset_of!(Sequence, last_token) + 4,
            offset_of!(Sequence, tail_shared) + 1,
            table + offset_of!(MirrorTable, last) + 4,
            table + offset_of!(MirrorTable, len) + 4,
        ]
        .into_iter()
        .max()
        .unwrap();
        assert!(
            seq_hot_end <= 64,
            "a hot sequence field ends at byte {seq_hot_end}"
        );
        for end in [
            offset_of!(Request, status) + 1,
            offset_of!(Request, quiet_until) + 8,
            offset_of!(Request, extra_key) + 8,
            offset_of!(Request, first_seq_id) + 8,
        ] {
            // The scheduler's slot puts an 8-byte generation word in front.
            assert!(end + 8 <= 64, "a hot request field ends at byte {end}");
        }
        // The inline sequence follows the hot fields: its hot part ends within the slot's
        // first 128 bytes (8-byte generation word in front of the request).
        let mut params = RequestParams {
            prompt: vec![1, 2, 3],
            n: 1,
            priority: 0,
            arrival_time: 0.0,
            stop: StopParams::default(),
            extra_key: 0,
            lora_id: 0,
            structured_output: false,
        };
        let req = Request::new("r", &mut params, 0, 0, 16, 16);
        let at = |p: *const u8| p as usize - &req as *const Request as usize;
        let seq = at(&req.seqs[0] as *const Sequence as *const u8);
        assert!(matches!(req.seqs, Seqs::One(_)));
        assert!(seq >= offset_of!(Request, first_seq_id) + 8);
        assert!(
            8 + seq + seq_hot_end <= 128,
            "the inline sequence's hot part ends at {seq}"
        );
        // Features' state comes last: adding to it never moves a hot field.
        assert!(offset_of!(Request, extras) >= offset_of!(Request, admitted_once));
        assert!(offset_of!(Request, extras) > offset_of!(Request, seqs));
    }

    #[test]
    fn rank_orders_priority_then_arrival_then_insertion() {
        assert!(rank_less((0, 5.0, 9), (1, 0.0, 0)));
        assert!(rank_less((1, 1.0, 9), (1, 2.0, 0)));
        assert!(rank_less((1, 1.0, 3), (1, 1.0, 4)));
        assert!(!rank_less((1, 1.0, 4), (1, 1.0, 4)));
    }
}
