//! Requests, their sequences, statuses and stop rules.
use crate::ids::{BlockId, SeqId, TokenId};

/// Lifecycle of a request (SPEC §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    Waiting,
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
        matches!(self, RequestStatus::Waiting | RequestStatus::Preempted)
    }
}

/// Why a sequence stopped (`CompletionOutput.finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id, or a stop string found by the caller.
    Stop,
    /// `max_tokens` or the model length.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Sampling limits the scheduler enforces (the sampler enforces the rest).
#[derive(Debug, Clone, Default)]
pub struct StopParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub eos_token_id: Option<TokenId>,
    pub stop_token_ids: Vec<TokenId>,
    pub ignore_eos: bool,
}

impl StopParams {
    /// Smallest total length at which `check` can return a stop for a request with a
    /// `prompt_len` prompt: the length caps, and EOS / stop ids once `min_tokens` are out
    /// (only if any can match). Below it `check` is `None` for every token.
    pub fn quiet_until(&self, prompt_len: usize, max_len: usize) -> usize {
        let mut until = (prompt_len + self.max_tokens).min(max_len);
        let token_rules =
            !self.stop_token_ids.is_empty() || (!self.ignore_eos && self.eos_token_id.is_some());
        if token_rules {
            until = until.min(prompt_len + self.min_tokens);
        }
        until
    }

    /// Stop rule for a sequence that just received `token`, making `num_output` generated
    /// tokens and `total_len` tokens in all. `min_tokens` holds back EOS and stop ids only;
    /// the length limits always apply.
    pub fn check(
        &self,
        token: TokenId,
        num_output: usize,
        total_len: usize,
        max_len: usize,
    ) -> Option<(FinishReason, Option<TokenId>)> {
        if num_output >= self.min_tokens {
            if !self.ignore_eos && self.eos_token_id == Some(token) {
                return Some((FinishReason::Stop, None));
            }
            if self.stop_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(token)));
            }
        }
        if num_output >= self.max_tokens || total_len >= max_len {
            return Some((FinishReason::Length, None));
        }
        None
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
}

/// One sample stream of a request (`n` of them per request).
///
/// Layout (`repr(C)`, 64-byte aligned): everything a decode step reads or writes per
/// sequence (the token vector's header, `num_computed`, `finished`, `last_token`,
/// `tail_shared` and the table's last block and length) sits in the first cache line; the
/// table's allocation header and the id follow in the second. Unit test
/// `hot_fields_share_a_cache_line` checks it.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
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
}

/// A request: one prompt and `n` sequences sampled from it.
///
/// Layout (`repr(C)`): the fields a decode step reads (`seqs`, `status`, `quiet_until`,
/// `prompt_len`, `first_seq_id`) come first, so that with the scheduler's slot generation in
/// front they share one cache line (unit test `hot_fields_share_a_cache_line`).
#[derive(Debug, Clone)]
#[repr(C)]
pub struct Request {
    pub seqs: Vec<Sequence>,
    pub status: RequestStatus,
    /// Whether the unfinished non-leader sequences currently exist in the manager. Before
    /// that only the leader (first unfinished sequence) holds blocks and computes the prompt.
    pub forked: bool,
    /// Sequence length below which no stop rule can fire (see `StopParams::quiet_until`):
    /// `update_from_output` skips the full check for a sampled token below it.
    pub quiet_until: usize,
    pub prompt_len: usize,
    /// Id of `seqs[0]` (sequence ids of a request are consecutive: `seqs[i].id` is
    /// `first_seq_id + i`).
    pub first_seq_id: SeqId,
    pub id: String,
    pub num_unfinished: usize,
    pub priority: i64,
    pub arrival_time: f64,
    /// Insertion counter: breaks ties between equal (priority, arrival).
    pub order: u64,
    pub stop: StopParams,
    pub extra_key: u64,
    /// Prompt tokens served by the prefix cache at the first admission.
    pub num_cached_tokens: usize,
    pub admitted_once: bool,
}

impl Request {
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

    /// Sequence indices holding (or about to hold) blocks: the leader before the fork, every
    /// unfinished sequence after it.
    pub fn active_seqs(&self) -> impl Iterator<Item = usize> + '_ {
        let leader = self.leader();
        let forked = self.forked;
        self.seqs
            .iter()
            .enumerate()
            .filter(move |(i, s)| !s.is_finished() && (forked || *i == leader))
            .map(|(i, _)| i)
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

    fn params() -> StopParams {
        StopParams {
            max_tokens: 5,
            min_tokens: 2,
            eos_token_id: Some(2),
            stop_token_ids: vec![9],
            ignore_eos: false,
        }
    }

    #[test]
    fn eos_stops_once_min_tokens_are_out() {
        let p = params();
        assert_eq!(p.check(2, 1, 10, 100), None);
        assert_eq!(p.check(2, 2, 10, 100), Some((FinishReason::Stop, None)));
    }

    #[test]
    fn stop_id_reports_itself_and_lengths_cap() {
        let p = params();
        assert_eq!(p.check(9, 3, 10, 100), Some((FinishReason::Stop, Some(9))));
        assert_eq!(p.check(7, 5, 10, 100), Some((FinishReason::Length, None)));
        assert_eq!(p.check(7, 3, 100, 100), Some((FinishReason::Length, None)));
        let ignore = StopParams {
            ignore_eos: true,
            ..params()
        };
        assert_eq!(ignore.check(2, 3, 10, 100), None);
    }

    #[test]
    fn quiet_until_is_the_first_length_a_rule_can_fire() {
        let variants = [
            params(),
            StopParams {
                ignore_eos: true,
                stop_token_ids: vec![],
                ..params()
            },
            StopParams {
                eos_token_id: None,
                ..params()
            },
            StopParams {
                min_tokens: 0,
                ..params()
            },
        ];
        for p in variants {
            for max_len in [6, 8, 100] {
                let until = p.quiet_until(3, max_len);
                for total in 4..max_len.min(3 + p.max_tokens) + 1 {
                    let fires = [2, 9, 7]
                        .iter()
                        .any(|&t| p.check(t, total - 3, total, max_len).is_some());
                    assert_eq!(
                        fires,
                        total >= until,
                        "{p:?} total {total} max_len {max_len}"
                    );
                }
            }
        }
    }

    #[test]
    fn hot_fields_share_a_cache_line() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(align_of::<Sequence>(), 64);
        let table = offset_of!(Sequence, table);
        for end in [
            offset_of!(Sequence, tokens) + size_of::<Vec<TokenId>>(),
            offset_of!(Sequence, num_computed) + 8,
            offset_of!(Sequence, finished) + size_of::<Option<(FinishReason, Option<TokenId>)>>(),
            offset_of!(Sequence, last_token) + 4,
            offset_of!(Sequence, tail_shared) + 1,
            table + offset_of!(MirrorTable, last) + 4,
            table + offset_of!(MirrorTable, len) + 4,
        ] {
            assert!(end <= 64, "a hot sequence field ends at byte {end}");
        }
        for end in [
            offset_of!(Request, seqs) + size_of::<Vec<Sequence>>(),
            offset_of!(Request, status) + 1,
            offset_of!(Request, quiet_until) + 8,
            offset_of!(Request, prompt_len) + 8,
            offset_of!(Request, first_seq_id) + 8,
        ] {
            // The scheduler's slot puts an 8-byte generation word in front.
            assert!(end + 8 <= 64, "a hot request field ends at byte {end}");
        }
    }

    #[test]
    fn rank_orders_priority_then_arrival_then_insertion() {
        assert!(rank_less((0, 5.0, 9), (1, 0.0, 0)));
        assert!(rank_less((1, 1.0, 9), (1, 2.0, 0)));
        assert!(rank_less((1, 1.0, 3), (1, 1.0, 4)));
        assert!(!rank_less((1, 1.0, 4), (1, 1.0, 4)));
    }
}
