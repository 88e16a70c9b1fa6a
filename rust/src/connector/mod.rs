//! KV connectors: the scheduler's side of a second KV tier (vLLM V1's KV connector API).
//!
//! A connector knows KV blocks that live outside the device cache (host memory, disk, another
//! engine), keyed by the same chained block hashes as the device prefix cache. The scheduler
//! asks it, for a request it admits, how many tokens past the device prefix hit it can load
//! (`get_num_new_matched_tokens`), allocates device blocks for them and tells it which
//! (`update_state_after_alloc`). A synchronous load (`is_async` false: the host tier) is
//! part of the step that admits the request: its tokens count as computed, the workers copy
//! the blocks in before that step's forward and report the load before its output. An
//! asynchronous one (the disk tier) parks the request in `WAITING_FOR_REMOTE_KVS` until the
//! workers report the load done. When a request finishes it asks the connector whether it
//! saves the request's blocks (`request_finished` -> delay_free): the blocks then stay
//! allocated until the workers report the save done. Each step the connector hands the
//! workers what to load and save as flat arrays (`build_connector_meta`, carried by the step's
//! output); the workers' reports come back through `update_connector_output`.
//!
//! Loads and saves are named by transfer ids (`job`) the scheduler assigns, unique for its
//! lifetime; the workers report them as vLLM's `get_finished` does (finished-loading and
//! finished-saving ids) plus the device blocks whose load failed (`invalid_blocks`).
pub mod disk;
pub mod offload;

use crate::ids::{BlockId, TokenId};
use crate::kv::KvEventLog;

pub use disk::{block_file_name, DiskConnector};
pub use offload::{OffloadConnector, OffloadStats};

/// What a connector sees of a request.
#[derive(Debug, Clone, Copy)]
pub struct ConnectorRequest<'a> {
    pub id: &'a str,
    /// The transfer this call opens (a load in `update_state_after_alloc`, a save in
    /// `request_finished`); meaningless in `get_num_new_matched_tokens`.
    pub job: u64,
    pub tokens: &'a [TokenId],
    /// Chain hashes of the request's full blocks (the device prefix cache's keys, salted with
    /// its LoRA adapter): block `i` covers `tokens[i * block_size..(i + 1) * block_size]`.
    pub block_hashes: &'a [u64],
}

/// One step's transfers for the workers, flat: load `l` copies the connector's entry
/// `load_slots[l]` (whose block hash is `load_hashes[l]`) into device block `load_blocks[l]`
/// as part of transfer `load_jobs[l]`; saves copy device blocks out the same way. The workers
/// run a step's transfers even when the step itself is discarded. The loads of the
/// transfers in `sync_jobs` are synchronous: the workers finish them before the step's
/// forward and report them (`update_connector_output`) before its output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectorMeta {
    pub load_jobs: Vec<u64>,
    pub load_blocks: Vec<i64>,
    pub load_slots: Vec<i64>,
    pub load_hashes: Vec<u64>,
    pub save_jobs: Vec<u64>,
    pub save_blocks: Vec<i64>,
    pub save_slots: Vec<i64>,
    pub save_hashes: Vec<u64>,
    pub sync_jobs: Vec<u64>,
}

impl ConnectorMeta {
    pub const EMPTY: ConnectorMeta = ConnectorMeta {
        load_jobs: Vec::new(),
        load_blocks: Vec::new(),
        load_slots: Vec::new(),
        load_hashes: Vec::new(),
        save_jobs: Vec::new(),
        save_blocks: Vec::new(),
        save_slots: Vec::new(),
        save_hashes: Vec::new(),
        sync_jobs: Vec::new(),
    };

    pub fn push_load(&mut self, job: u64, block: BlockId, slot: u32, hash: u64) {
        self.load_jobs.push(job);
        self.load_blocks.push(block as i64);
        self.load_slots.push(slot as i64);
        self.load_hashes.push(hash);
    }

    pub fn push_save(&mut self, job: u64, block: BlockId, slot: u32, hash: u64) {
        self.save_jobs.push(job);
        self.save_blocks.push(block as i64);
        self.save_slots.push(slot as i64);
        self.save_hashes.push(hash);
    }

    pub fn is_empty(&self) -> bool {
        self.load_jobs.is_empty() && self.save_jobs.is_empty()
    }

    /// Moves everything into `into` (appending), leaving `self` empty.
    pub fn drain_into(&mut self, into: &mut ConnectorMeta) {
        into.load_jobs.append(&mut self.load_jobs);
        into.load_blocks.append(&mut self.load_blocks);
        into.load_slots.append(&mut self.load_slots);
        into.load_hashes.append(&mut self.load_hashes);
        into.save_jobs.append(&mut self.save_jobs);
        into.save_blocks.append(&mut self.save_blocks);
        into.save_slots.append(&mut self.save_slots);
        into.save_hashes.append(&mut self.save_hashes);
        into.sync_jobs.append(&mut self.sync_jobs);
    }

    pub fn clear(&mut self) {
        self.load_jobs.clear();
        self.load_blocks.clear();
        self.load_slots.clear();
        self.load_hashes.clear();
        self.save_jobs.clear();
        self.save_blocks.clear();
        self.save_slots.clear();
        self.save_hashes.clear();
        self.sync_jobs.clear();
    }
}

/// What the workers report after a step (vLLM's `get_finished`, plus failed loads).
#[derive(Debug, Clone, Copy, Default)]
pub struct ConnectorOutput<'a> {
    /// Transfers whose loads are all done (failed ones included).
    pub finished_recving: &'a [u64],
    /// Transfers whose saves are all done.
    pub finished_sending: &'a [u64],
    /// Device blocks (of `finished_recving` transfers) whose load failed: their tokens are
    /// computed again, and the connector forgets the entries they were loaded from.
    pub invalid_blocks: &'a [BlockId],
}

/// The scheduler's side of a KV connector (vLLM's names).
pub trait KvConnector: std::fmt::Debug + Send + Sync {
    /// Tokens past `num_computed` (a block boundary: the device prefix hit) that the
    /// connector can load, a multiple of the block size and never the prompt's last token;
    /// and whether they load asynchronously: the scheduler then parks the request while
    /// they load; a synchronous load is part of the step that admits the request (the
    /// workers copy the blocks in before its forward).
    fn get_num_new_matched_tokens(
        &mut self,
        req: &ConnectorRequest<'_>,
        num_computed: usize,
    ) -> (usize, bool);

    /// The request's device blocks after allocation: the last
    /// `num_external_tokens / block_size` of them receive the loaded tokens (transfer
    /// `req.job`).
    fn update_state_after_alloc(
        &mut self,
        req: &ConnectorRequest<'_>,
        blocks: &[BlockId],
        num_external_tokens: usize,
    );

    /// Appends this step's loads and saves to `meta`.
    fn build_connector_meta(&mut self, meta: &mut ConnectorMeta);

    /// A request finished; `blocks` are its computed full blocks (`req.block_hashes` has
    /// theirs). Returns delay_free: true when the connector saves some of them under transfer
    /// `req.job`, which keeps them allocated until the save is reported.
    fn request_finished(&mut self, req: &ConnectorRequest<'_>, blocks: &[BlockId]) -> bool;

    /// The workers' report of finished transfers.
    fn update_connector_output(&mut self, out: &ConnectorOutput<'_>);

    /// Blocks (by hash) whose copy in the tier the workers deleted (the disk tier's evictions
    /// to stay within its size), so the tier publishes them removed without looking.
    fn tier_removed(&mut self, _hashes: &[u64]) {}

    /// Counters of the tier, when it keeps any.
    fn offload_stats(&self) -> Option<OffloadStats> {
        None
    }

    /// The tier's KV-event log (its blocks stored and removed, on its medium), when it
    /// keeps one: a publisher turns it on and drains it with the prefix cache's.
    fn kv_events_mut(&mut self) -> Option<&mut KvEventLog> {
        None
    }
}
