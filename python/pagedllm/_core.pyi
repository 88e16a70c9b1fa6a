"""Type stubs for the compiled core `pagedllm._core` (Rust, PyO3)."""

from __future__ import annotations

from collections.abc import Iterable as _Iterable
from collections.abc import Sequence as _Sequence
from typing import ClassVar, final

import numpy as _np
import numpy.typing as _npt

__version__: str

# =============================================================================================
# Memory manager (rust/src/bindings/manager.rs)
# =============================================================================================

class PagedLLMError(Exception):
    """Error raised by the pagedllm core: out of blocks, invalid state, broken invariant.

    Bad arguments (unknown or duplicate sequence ids, negative counts, out-of-range values)
    raise ``ValueError`` instead.
    """

ROOT_HASH: int
"""Parent hash of a sequence's first block in the prefix-cache hash chain."""

@final
class AllocStatus:
    """Answer of the admission checks (`can_allocate`, `can_swap_in`)."""

    OK: ClassVar[AllocStatus]
    """Fits now."""
    LATER: ClassVar[AllocStatus]
    """Does not fit now (free blocks minus the watermark); may once blocks are freed."""
    NEVER: ClassVar[AllocStatus]
    """Can never fit in this pool."""
    def __int__(self) -> int: ...

@final
class PrefixHit:
    """Result of `KVCacheManager.lookup`."""

    @property
    def num_cached_tokens(self) -> int:
        """Tokens covered by `blocks` (``len(blocks) * block_size``)."""
    @property
    def blocks(self) -> list[int]:
        """Device blocks of the longest run of leading cached full blocks (the block holding the
        last token is never part of it: that token is always computed)."""
    @property
    def others(self) -> list[list[int]]:
        """A hybrid manager's layer groups 1.. (rows like ``blocks``; ``2**32 - 1`` where the
        group's window reads no block); empty otherwise."""
    @property
    def hashes(self) -> list[int]:
        """Chain hashes of every full block of the looked-up tokens (empty with caching off)."""

class KVCacheManager:
    """Paged KV-cache memory manager: device and host block pools with ref-counted blocks,
    per-sequence block tables, fork / copy-on-write, swap and a prefix cache.

    Block ids of the two pools are independent (device ``0..num_gpu_blocks``, host
    ``0..num_cpu_blocks``). The KV slot of token ``t`` of a sequence is
    ``table[t // block_size] * block_size + t % block_size``.

    Every call that fails (exception, or a ``None`` / ``False`` "not enough blocks" answer)
    leaves the manager unchanged.
    """

    def __init__(
        self,
        *,
        num_gpu_blocks: int,
        block_size: int = 16,
        num_cpu_blocks: int = 0,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
    ) -> None:
        """Raises ValueError for block_size 0, a negative count, or watermark outside [0, 1)."""

    # ---- allocation ------------------------------------------------------------------------
    def allocate(
        self,
        seq_id: int,
        token_ids: list[int],
        *,
        num_slots: int | None = None,
        extra_key: int = 0,
        apply_watermark: bool = True,
    ) -> int | None:
        """Creates the block table of a new sequence, reusing the longest cached prefix.

        `num_slots` (default: all tokens) is how many token slots the table must cover.
        Counts one prefix-cache query. Returns the number of reused (cached) tokens, or None
        when the free blocks (minus the watermark if `apply_watermark`) do not suffice.
        Raises ValueError for an existing `seq_id`.
        """
    def allocate_hit(
        self, seq_id: int, hit: PrefixHit, num_slots: int, *, apply_watermark: bool = True
    ) -> bool:
        """Allocates from a `lookup` result. False when out of blocks; ValueError when the hit is
        stale (one of its blocks was evicted since) or covers more than `num_slots`."""
    def lookup(self, token_ids: list[int], *, extra_key: int = 0, count: bool = False) -> PrefixHit:
        """Prefix-cache query. Read-only unless `count`, which adds it to the hit/miss counters."""
    def append_slots(
        self, seq_id: int, first_new_slot: int, num_slots: int
    ) -> list[tuple[int, int]] | None:
        """Grows the table to cover `num_slots` slots. Each shared block that slots
        ``[first_new_slot, num_slots)`` write into is copied first (copy-on-write). Returns the
        ``(src, dst)`` block pairs to copy, or None (no change) when out of device blocks."""
    def cache_full_blocks(
        self, seq_id: int, token_ids: list[int], num_computed_tokens: int, *, extra_key: int = 0
    ) -> int:
        """Registers in the prefix cache every block fully inside
        ``token_ids[:num_computed_tokens]`` not registered yet (call at schedule time). A hash
        already mapped to another block is left as is. Returns the number newly registered."""
    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """The child shares every block of the parent (ref count +1 each)."""
    def free(self, seq_id: int) -> None:
        """Releases the sequence's blocks (device or host). Cached full blocks keep their
        contents and wait in the eviction queue. ValueError for an unknown id (double free)."""

    # ---- admission -------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> AllocStatus:
        """NEVER: more blocks than the pool minus the watermark; LATER: not enough free blocks
        now while keeping the watermark free; OK otherwise."""
    def can_allocate_with_prefix(self, hit: PrefixHit, num_slots: int) -> AllocStatus:
        """`can_allocate` counting only the blocks `allocate_hit(hit, num_slots)` would take."""
    def can_append_slots(self, num_running_seqs: int, num_lookahead_slots: int = 0) -> bool:
        """Conservative: one free block per running sequence plus its lookahead blocks."""

    # ---- swap ------------------------------------------------------------------------------
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether the host pool can hold the group's distinct device blocks."""
    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Moves the group's blocks to the host, each shared block once. Returns the
        ``(device, host)`` pairs to copy. PagedLLMError when the host pool is too small."""
    def can_swap_in(self, seq_ids: list[int], num_lookahead_slots: int = 0) -> AllocStatus:
        """NEVER when the group's blocks exceed the device pool; LATER when they do not fit now
        (watermark kept free); OK otherwise."""
    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """The reverse of `swap_out`. Returns ``(host, device)`` pairs. PagedLLMError when the
        device pool has too few free blocks."""

    # ---- inspection ------------------------------------------------------------------------
    def block_table(self, seq_id: int) -> list[int]: ...
    def is_swapped(self, seq_id: int) -> bool:
        """True when the sequence's blocks are on the host. ValueError for an unknown id."""
    def contains(self, seq_id: int) -> bool: ...
    def __contains__(self, seq_id: int) -> bool: ...
    def seq_ids(self) -> list[int]:
        """Known sequence ids, sorted."""
    def ref_count(self, block_id: int, *, device: bool = True) -> int: ...
    def block_hash(self, block_id: int) -> int | None:
        """Hash the device block is registered under in the prefix cache, or None."""
    def evictable_blocks(self) -> list[int]:
        """Cached device blocks with ref count 0, in eviction order (first evicted first)."""
    def usage(self) -> float:
        """Fraction of device blocks in use (cached-evictable blocks count as free)."""
    def cpu_usage(self) -> float:
        """Fraction of host blocks in use."""
    def stats(self) -> dict[str, int | float]:
        """block_size, num_gpu_blocks, num_cpu_blocks, num_free_gpu_blocks, num_free_cpu_blocks,
        num_cached_gpu_blocks, num_registered_blocks, num_sequences, num_swapped_sequences,
        gpu_usage, cpu_usage, watermark_blocks, prefix_cache_queries,
        prefix_cache_query_blocks, prefix_cache_hits, prefix_cache_misses,
        prefix_cache_evictions, prefix_cache_hit_rate (hits / query_blocks)."""
    def check_invariants(self) -> None:
        """Raises PagedLLMError naming the first violated invariant (free + in use = total per
        pool, ref counts = table references, nothing both free and referenced, prefix-cache map
        consistent with the blocks)."""
    def reset_prefix_cache(self) -> None:
        """Drops every prefix-cache entry; cached-evictable blocks become plain free blocks.
        The hit/miss/eviction counters are kept."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_gpu_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def num_free_gpu_blocks(self) -> int:
        """Free device blocks, cached-evictable ones included."""
    @property
    def num_free_cpu_blocks(self) -> int: ...
    @property
    def num_cached_gpu_blocks(self) -> int:
        """Device blocks with ref count 0 whose contents are still cached (evictable)."""
    @property
    def num_sequences(self) -> int: ...
    @property
    def watermark_blocks(self) -> int:
        """``int(watermark * num_gpu_blocks)``."""
    @property
    def enable_prefix_caching(self) -> bool: ...

def hash_block(parent_hash: int, token_ids: list[int], extra_key: int = 0) -> int:
    """Chained 64-bit hash of one block (`parent_hash` = ROOT_HASH for the first block)."""

def hash_block_chain(
    token_ids: list[int], block_size: int, extra_key: int = 0, parent_hash: int = ...
) -> list[int]:
    """Chain hashes of every full block of `token_ids`, continuing the chain whose last block
    hashed to `parent_hash` (default ROOT_HASH: from a sequence's first block)."""

def lora_hash_key(lora_id: int, extra_key: int = 0) -> int:
    """The prefix-cache hash key of a request run with LoRA adapter ``lora_id`` (0: none): what
    the scheduler salts its blocks with, so a router hashes prompts the way the cache does."""

def encode_kv_event_batch(
    ts: float,
    kinds: _npt.NDArray[_np.uint8],
    starts: _npt.NDArray[_np.uint32],
    parents: _npt.NDArray[_np.uint64],
    extra_keys: _npt.NDArray[_np.uint64],
    hashes: _npt.NDArray[_np.uint64],
    tokens: _npt.NDArray[_np.uint32],
    *,
    block_size: int,
    lora_keys: list[int],
    lora_ids: list[int],
    medium: str | None = None,
    data_parallel_rank: int | None = None,
) -> bytes:
    """One step's KV events (the arrays ``Scheduler.drain_kv_events`` returns) as vLLM 0.32's
    msgpack ``KVEventBatch``, byte for byte as its msgspec encoder writes it: ``[ts, [event,
    ...], data_parallel_rank | None]`` with ``{"type": "BlockStored", "block_hashes",
    "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx"}``, ``{"type": "BlockRemoved", "block_hashes", "medium",
    "group_idx"}`` and ``{"type": "AllBlocksCleared"}``. Empty ``tokens``: stored blocks list
    no token ids."""

KV_EVENT_STORED: int
KV_EVENT_REMOVED: int
KV_EVENT_ALL_CLEARED: int
KV_EVENT_MEDIA: tuple[str, ...]
"""vLLM's ``medium`` names by medium code: ("GPU", "CPU", "STORAGE") (the device cache, the
host tier, the disk tier)."""

class KvEventStream:
    """The engine's side of its KV-event stream: ``publish_step`` drains a step's events (the
    prefix cache's, then the offload tier's), encodes them as one msgpack ``KVEventBatch`` and
    keeps the blocks they add up to per medium (``snapshot``'s source)."""

    def __init__(
        self,
        block_size: int,
        *,
        medium: str | None = None,
        data_parallel_rank: int = 0,
        hashes_only: bool = False,
    ) -> None:
        """``medium``: the name of the device cache's medium (vLLM's ``GPU``, on every device);
        the tiers' are ``CPU`` (host) and ``STORAGE`` (disk)."""
    def note_lora(self, lora_id: int) -> None:
        """Blocks of adapter ``lora_id`` report it as their ``lora_id``."""
    def publish_step(self, scheduler: Scheduler) -> bytes | None:
        """The scheduler's events since the last step as one batch; None when there are none."""
    def publish(self, events: tuple[_npt.NDArray, ...]) -> bytes | None:
        """``publish_step`` for arrays already drained (``Scheduler.drain_kv_events``)."""
    def snapshot(self) -> bytes:
        """``[AllBlocksCleared, BlockStored(device blocks), BlockStored(per tier holding any)]``,
        listing no tokens."""

class ForeignHashes:
    """One replica's table of another engine's block hashes -> this router's (re-hashed from
    the tokens its stored events carry); changes are staged per batch."""

    def __init__(self, block_size: int) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def own(self) -> dict[int, int]:
        """The kept table: {foreign hash: own hash}."""
    def commit(self) -> None:
        """Keeps the changes of the batch last translated (the index applied it)."""
    def rollback(self) -> None:
        """Drops them (the index did not apply it)."""
    def reset(self) -> None:
        """Forgets every block (the replica starts over)."""

def foreign_key(block_hash: int | bytes) -> int:
    """A published hash as a table key: its low 64 bits (digest bytes' last 8)."""

def decode_kv_event_batch(payload: bytes) -> dict[str, _npt.NDArray | float | int | None]:
    """A msgpack ``KVEventBatch`` as arrays: ``ts``, ``data_parallel_rank``, ``kinds`` [R]
    (``KV_EVENT_*``), ``media`` [R] (indexes into ``KV_EVENT_MEDIA``), ``starts`` [R+1]
    (record r's hashes are ``hashes[starts[r]:starts[r+1]]``), ``hashes`` (digest bytes as
    their low 64 bits), ``hash_is_int`` (per hash), ``parents`` [R] (ROOT_HASH: none),
    ``token_starts`` [R+1], ``tokens``, ``block_sizes`` [R] (0: none), ``lora_ids`` [R] (0:
    none), ``plain`` [R] (no adapter name, no extra keys). Events of unknown kinds are left out;
    ValueError naming what is wrong for a payload that is not a batch."""

def kv_event_index_records(
    payload: bytes, foreign: ForeignHashes | None = None
) -> tuple[
    _npt.NDArray[_np.uint8],
    _npt.NDArray[_np.uint32],
    _npt.NDArray[_np.uint64],
    _npt.NDArray[_np.uint8],
]:
    """What the router's index applies from a batch: (kinds, starts, hashes, media). Without
    ``foreign``, the hashes published as integers; with it, the blocks re-hashed into this
    router's hashes (the table's changes staged). ValueError for a payload that is not a batch."""

ROUTING_POLICIES: list[str]
MAX_ROUTER_REPLICAS: int
"""The most replicas one router indexes (a replica is a bit of each block's holder mask)."""

class Router:
    """The data-parallel router core: a prefix index (block hash -> replicas) built from the
    replicas' KV events, per-replica load, and the routing policies (``ROUTING_POLICIES``)."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "cache_aware",
        *,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        load_weight: float = 0.5,
        token_weight: float = 0.0,
        pending_ttl: float = 120.0,
        affinity_weight: float = 1.0,
        divert_ratio: float = 5.0,
    ) -> None: ...
    @property
    def num_replicas(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def policy(self) -> str: ...
    def route(
        self,
        token_ids: list[int],
        *,
        lora_id: int = 0,
        session: str | None = None,
        excluded: int = 0,
        now: float = 0.0,
    ) -> tuple[int, int, int, int, int]:
        """``(replica, matched_blocks, eligible_blocks, uncached_tokens, ticket)`` for a
        prompt; the replica counts it (and its uncached tokens) in flight until
        ``finish(ticket)``, and its blocks count as held there (pending) until then
        (``pending_ttl`` seconds at most): that replica holds them or will once its prefill runs.
        ``excluded``: a mask of replicas not to pick. ``PagedLLMError`` when no live replica is
        left."""
    def finish(self, ticket: int) -> None:
        """The request of ``ticket`` ended (or failed): it and its pending blocks stop counting
        on its replica (what its prefill stored, the events say). An ended ticket, or one
        dropped when its replica left rotation, is ignored; ``ValueError`` for one never
        issued."""
    def set_alive(self, replica: int, alive: bool) -> None: ...
    def is_alive(self, replica: int) -> bool: ...
    def set_load(self, replica: int, waiting: int, running: int, kv_usage: float) -> None: ...
    def apply_events(
        self,
        replica: int,
        seq: int,
        kinds: _npt.NDArray[_np.uint8],
        starts: _npt.NDArray[_np.uint32],
        hashes: _npt.NDArray[_np.uint64],
        media: _npt.NDArray[_np.uint8] | None = None,
    ) -> int:
        """Applies batch ``seq`` of the replica's events (``media``: each record's medium code,
        None: all on the device): -1 applied, -2 stale (already applied), else the sequence
        number to replay from (batches were lost)."""
    def apply_snapshot(
        self,
        replica: int,
        seq: int,
        hashes: _npt.NDArray[_np.uint64],
        media: _npt.NDArray[_np.uint8] | None = None,
    ) -> None:
        """Replaces the replica's part of the index with its cache as of batch ``seq``
        (``media``: each hash's medium code, None: all on the device)."""
    def reset_replica(self, replica: int) -> None:
        """Forgets the replica's part (a restarted replica: batches from 0 again)."""
    def set_index_capacity(self, replica: int, blocks: int) -> None:
        """Bounds the replica's part of the index to ``blocks`` (its cache's size; 2^20 until
        set): blocks stored past it are dropped, counted in ``stats()``'s ``dropped_blocks``."""
    def next_seq(self, replica: int) -> int: ...
    def replica_hashes(self, replica: int) -> _npt.NDArray[_np.uint64]:
        """Every block hash the index says the replica holds (in no order)."""
    def expire_pending(self, now: float) -> None: ...
    def num_pending(self, replica: int, *, now: float = 0.0) -> int:
        """Blocks of the requests in flight on the replica that count as held there."""
    def stats(self) -> list[dict[str, int | float | bool]]:
        """Per replica: routed, query_blocks, hit_blocks, in_flight, uncached_tokens, waiting,
        running, kv_usage, alive, indexed_blocks, index_capacity, dropped_blocks,
        host_tier_blocks, disk_tier_blocks."""

def _time_hash_block(block_size: int, iterations: int = 1_000_000) -> float:
    """Benchmark helper: nanoseconds per chained hash of a `block_size`-token block, timed
    inside Rust."""

# =============================================================================================
# End of memory manager section
# =============================================================================================

# =============================================================================================
# Scheduler (rust/src/bindings/scheduler.rs)
# =============================================================================================

_IntArray = _npt.NDArray[_np.integer] | _Sequence[int]

SCHEDULING_STRATEGIES: tuple[str, ...]
"""Values of ``scheduling``, the default first."""
POLICIES: tuple[str, ...]
"""Values of ``policy``, the default first."""
PREEMPTION_MODES: tuple[str | None, ...]
"""Values of ``preemption_mode``, the default (``None``: chosen per group) first."""
DEFAULTS: dict[str, int | float | bool | str | None]
"""Defaults of the scheduler and cache knobs (``EngineArgs`` reads them)."""
SCHEDULER_OUTPUT_FIELDS: list[str]
"""Every field of ``SchedulerOutput``, in declaration order."""
STEP_INPUT_SCALARS: list[str]
"""The ``SchedulerOutput`` scalars the model runner reads (what a step carries to every rank)."""
STEP_INPUT_ARRAYS: list[str]
"""The ``SchedulerOutput`` arrays the model runner reads (what a step carries to every rank)."""

def default_max_num_batched_tokens(scheduling: str, max_model_len: int) -> int:
    """The token budget ``max_num_batched_tokens=None`` stands for: ``prefill_first`` must fit
    a whole prompt of ``max_model_len`` (at least 2048), the chunking strategies take 8192."""

def check_scheduler_config(
    *,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    scheduling: str = "unified",
    policy: str = "fcfs",
    preemption_mode: str | None = None,
    watermark: float = 0.01,
    long_prefill_token_threshold: int = 0,
    delay_factor: float = 0.0,
) -> None:
    """Check the scheduler's and the cache's knobs as the ``Scheduler`` constructor would,
    building nothing: ``ValueError`` naming the knob and the value (integers must be ints).
    ``max_model_len`` / ``max_num_batched_tokens`` None: not checked. ``EngineArgs`` asks it."""

def min_kv_blocks(
    max_model_len: int,
    *,
    block_size: int = 16,
    watermark: float = 0.01,
    scheduling: str = "unified",
    max_num_batched_tokens: int | None = None,
    kv_groups: list[int | None] | None = None,
) -> int:
    """The fewest KV-cache blocks with which the longest sequence the scheduler can hold
    (``max_model_len``; under ``prefill_first`` at most the token budget) is ever admitted: its
    blocks plus the ``watermark``'s share, the cache admission's rule. Start-up sizing asks it.
    ``kv_groups``: the cache's layer groups (``Scheduler.set_kv_groups``), a window group's
    blocks bounded by its window and the prefill chunk."""

def ngram_lookup_bounds(
    prompt_lookup_max: int | None = None, prompt_lookup_min: int | None = None
) -> tuple[int, int]:
    """The n-gram lookup bounds ``(max, min)`` from the ones given: one given, the other takes
    its value; neither, 4 and 1. ``ValueError`` when either is 0 or min > max."""

def kv_block_file_name(block_hash: int) -> str:
    """The disk KV tier's file name of the block with chained hash ``block_hash``."""

def request_id_list(request_ids: str | _Iterable[str]) -> list[str]:
    """``abort_request``'s argument as a list of ids: one str, or an iterable of str;
    ``TypeError`` naming what was given for anything else (the engine's ``abort_request``)."""

@final
class SchedulerOutput:
    """One step's work as arrays, each built on first access. S = scheduled sequences,
    T = tokens, K = samples. Block operations run in the order swap out, swap in, copy."""
    @property
    def step(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_samples(self) -> int: ...
    @property
    def num_batched_tokens(self) -> int: ...
    @property
    def is_decode_only(self) -> bool: ...
    @property
    def seq_ids(self) -> _npt.NDArray[_np.int64]: ...
    @property
    def request_ids(self) -> list[str]: ...
    @property
    def seq_index(self) -> _npt.NDArray[_np.int32]: ...
    @property
    def num_tokens(self) -> _npt.NDArray[_np.int32]: ...
    @property
    def start_pos(self) -> _npt.NDArray[_np.int32]: ...
    @property
    def seq_lens(self) -> _npt.NDArray[_np.int32]: ...
    @property
    def query_start_loc(self) -> _npt.NDArray[_np.int32]: ...
    @property
    def input_ids(self) -> _npt.NDArray[_np.int64]: ...
    @property
    def positions(self) -> _npt.NDArray[_np.int64]: ...
    @property
    def slot_mapping(self) -> _npt.NDArray[_np.int64]: ...
    @property
    def block_tables(self) -> _npt.NDArray[_np.int32]:
        """[S, W] padded with 0 to the widest table of the step."""
    @property
    def kv_group_tables(self) -> _npt.NDArray[_np.int32]:
        """int32 [G, S, W] each KV layer group's block tables (-1: released by a window);
        [0, S, 0] with one full-attention group."""
    @property
    def kv_group_slots(self) -> _npt.NDArray[_np.int64]:
        """int64 [G, T] each token's KV slot in each group; [0, T] with one group."""
    @property
    def sample_rows(self) -> _npt.NDArray[_np.int64]: ...
    @property
    def sample_seq_ids(self) -> _npt.NDArray[_np.int64]: ...
    @property
    def sample_request_ids(self) -> list[str]: ...
    @property
    def sample_seq_index(self) -> _npt.NDArray[_np.int32]: ...
    @property
    def blocks_to_copy(self) -> _npt.NDArray[_np.int64]:
        """[C, 2] (src, dst) device blocks."""
    @property
    def blocks_to_swap_out(self) -> _npt.NDArray[_np.int64]:
        """[O, 2] (device, host) blocks."""
    @property
    def blocks_to_swap_in(self) -> _npt.NDArray[_np.int64]:
        """[I, 2] (host, device) blocks."""
    @property
    def preempted(self) -> list[str]: ...
    @property
    def lora_ids(self) -> _npt.NDArray[_np.int64]:
        """[S] LoRA adapter of each scheduled sequence (0 = base model)."""
    @property
    def finished(self) -> list[tuple[str, str]]:
        """(request_id, reason) of requests that can never be served."""
    @property
    def spec_num_draft_tokens(self) -> _npt.NDArray[_np.int32]:
        """[S] draft tokens at the end of each row's ``num_tokens`` (speculative decoding;
        all 0 when the step has none)."""
    @property
    def spec_draft_token_ids(self) -> _npt.NDArray[_np.int64]:
        """[D] the draft tokens to verify, row order."""
    @property
    def structured_output_samples(self) -> _npt.NDArray[_np.int64]:
        """[G] indices (into the K samples) of the samples drawn under a grammar."""
    @property
    def kv_load_jobs(self) -> _npt.NDArray[_np.uint64]:
        """[L] KV connector: the transfer of each load this step starts."""
    @property
    def kv_load_blocks(self) -> _npt.NDArray[_np.int64]:
        """[L] the device block each load writes."""
    @property
    def kv_load_slots(self) -> _npt.NDArray[_np.int64]:
        """[L] the tier's slot each load reads."""
    @property
    def kv_load_hashes(self) -> _npt.NDArray[_np.uint64]:
        """[L] the block hash each load expects to find in its slot."""
    @property
    def kv_save_jobs(self) -> _npt.NDArray[_np.uint64]:
        """[M] KV connector: the transfer of each save this step starts."""
    @property
    def kv_save_blocks(self) -> _npt.NDArray[_np.int64]:
        """[M] the device block each save reads."""
    @property
    def kv_save_slots(self) -> _npt.NDArray[_np.int64]:
        """[M] the tier's slot each save writes."""
    @property
    def kv_save_hashes(self) -> _npt.NDArray[_np.uint64]:
        """[M] the block hash of each saved block."""
    @property
    def kv_sync_jobs(self) -> _npt.NDArray[_np.uint64]:
        """[S] the transfers whose loads are synchronous: copied in before this step's
        forward and reported (`update_connector_output`) before its output."""

class Scheduler:
    """The engine's scheduler (strategies unified / prefill_first / chunked_prefill,
    policies fcfs / priority, preemption None / "recompute" / "swap"), usable without a model."""
    def __init__(
        self,
        *,
        num_gpu_blocks: int,
        block_size: int = 16,
        num_cpu_blocks: int = 0,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        scheduling: str = "unified",
        policy: str = "fcfs",
        preemption_mode: str | None = None,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        long_prefill_token_threshold: int = 0,
        num_lookahead_slots: int = 0,
        delay_factor: float = 0.0,
        max_loras: int = 0,
        num_speculative_tokens: int = 0,
        prompt_lookup_max: int | None = None,
        prompt_lookup_min: int | None = None,
        kv_offloading_blocks: int = 0,
        kv_offloading_path: str | None = None,
    ) -> None:
        """``kv_offloading_blocks`` > 0 attaches the native offload tier's index with that
        many block slots (the workers own the memory): finished requests' blocks are saved
        into it, and a request whose prefix is there waits in ``WAITING_FOR_REMOTE_KVS`` while
        it loads. ``kv_offloading_path``: the disk tier instead, a directory of block files
        (``kv_block_file_name``) shared with other engines.
        ``max_loras``: most distinct LoRA adapters (``lora_id`` != 0) one step holds; 0 =
        LoRA off (a request with an adapter is then a ``ValueError``).
        ``num_speculative_tokens`` > 0 turns on n-gram speculation (``propose_drafts``) with
        lookups of ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens (one missing takes the
        other's value; both missing: 1 .. 4); ``ValueError`` when min > max or either is 0."""
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _IntArray,
        *,
        n: int = 1,
        best_of: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        max_tokens: int = 16,
        min_tokens: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: _IntArray | None = None,
        ignore_eos: bool = False,
        extra_key: int = 0,
        lora_id: int = 0,
        structured_output: bool = False,
    ) -> None:
        """Queue a request (``lora_id``: its adapter, 0 = base model; salts its prefix-cache
        keys; ``best_of``: the sequences it runs when given, else ``n``). ``ValueError`` naming
        the request (and the field and its limit) for an empty prompt, a duplicate id, ``n`` /
        ``best_of`` above ``max_num_seqs``, ``min_tokens`` above ``max_tokens``, a non-finite
        ``arrival_time``, a ``lora_id`` with LoRA off (``max_loras=0``), token ids that are
        not integers (floats, bools, strings are refused, never truncated), integers outside
        their range (counts and ``priority``: int64; token ids: uint32; ``extra_key``: uint64);
        ``TypeError`` for a ``request_id`` that is not a str. Nothing is queued then. A request
        that can never be served (prompt too long, more blocks than the cache) is reported by
        the next ``schedule()`` in ``finished``. ``structured_output=True``: it samples under a
        grammar still compiling, and waits (letting others pass) until ``grammar_ready``."""
    def validate_request(
        self,
        request_id: str,
        prompt_token_ids: _IntArray,
        *,
        n: int = 1,
        best_of: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        max_tokens: int = 16,
        min_tokens: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: _IntArray | None = None,
        ignore_eos: bool = False,
        extra_key: int = 0,
        lora_id: int = 0,
        structured_output: bool = False,
    ) -> list[int]:
        """``add_request``'s checks (same arguments, same errors) without queuing anything, for
        a caller that builds its own state of the request first; returns the prompt token ids
        as a list of ints."""
    def grammar_ready(self, request_id: str) -> bool:
        """Mark the grammar of a ``structured_output`` request compiled: schedulable from the
        next ``schedule()``. False for unknown/finished ids or one already marked;
        ``ValueError`` for a request without structured output. A failed compile: abort it."""
    def fork_beams(self, output: SchedulerOutput, request_id: str, parents: list[int]) -> int:
        """Beam search, between ``output``'s forward and its ``update_from_output``: sequence
        ``i`` continues sequence ``parents[i]`` (a copy-on-write fork of its blocks); a parent
        keeps its place. Returns how many sequences were forked."""
    def schedule(self, now: float | None = None) -> SchedulerOutput: ...
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: _IntArray,
        stop_string_hit: _npt.NDArray[_np.bool_] | _Sequence[bool] | None = None,
        *,
        num_tokens: _IntArray | None = None,
    ) -> list[tuple[str, int, str, int | None, bool]]:
        """(request_id, seq_index, finish_reason, stop_reason, request_finished) per finished
        sequence. ``sampled_token_ids`` must be integers (an integer-dtype array or a list of
        ints): a float or bool array is a ``ValueError`` naming it, never truncated. With
        ``num_tokens`` (speculative decoding) sample k brings ``num_tokens[k]`` consecutive
        tokens (its accepted drafts, then the target's token: 1 ..= drafts + 1), appended one by
        one under the stop rules; tokens after a stop are dropped, rejected drafts' blocks are
        given back."""
    def stop_cuts(
        self,
        output: SchedulerOutput,
        sampled_token_ids: _IntArray,
        num_tokens: _IntArray | None = None,
    ) -> tuple[_npt.NDArray[_np.int64], _npt.NDArray[_np.bool_]]:
        """Where the stop rules end the tokens of ``output`` (the latest step, before
        ``update_from_output``): one token per sample, or with ``num_tokens`` a run per sample.
        ``(kept int64 [K], by_token bool [K])``: the tokens each sequence keeps, and whether the
        last kept one ends it by itself (EOS or a stop id once ``min_tokens`` are out: its text
        is not part of the output); ``update_from_output`` ends them at the same place."""
    def discard_step(self, output: SchedulerOutput) -> list[str]:
        """Take back ``output`` (the latest step, before ``update_from_output``) when it could
        not be computed: its requests and the groups it swapped out go back to the head of
        ``waiting`` to be recomputed (generated tokens kept), its prefix-cache registrations
        are forgotten. Returns the ids rolled back. ``PagedLLMError`` for any other step."""
    def abort_request(self, request_id: str | _Iterable[str]) -> None:
        """Abort one id or an iterable of ids; unknown and finished ids are ignored. Anything
        but a str or an iterable of str is a ``TypeError``, raised before anything is aborted."""
    def num_waiting(self) -> int: ...
    def num_running(self) -> int: ...
    def num_swapped(self) -> int: ...
    def has_unfinished_requests(self) -> bool: ...
    def waiting_ids(self) -> list[str]: ...
    def running_ids(self) -> list[str]: ...
    def swapped_ids(self) -> list[str]: ...
    def request_status(self, request_id: str) -> str | None: ...
    def num_cached_tokens(self, request_id: str) -> int | None: ...
    def num_external_tokens(self, request_id: str) -> int | None:
        """The part of ``num_cached_tokens`` the KV connector (offload tier) loaded."""
    def update_connector_output(
        self,
        finished_recving: _Iterable[int],
        finished_sending: _Iterable[int],
        invalid_blocks: _Iterable[int] = ...,
        removed_hashes: _Iterable[int] = ...,
    ) -> None:
        """The workers' report of the KV connector's transfers: finished loads, finished
        saves, device blocks whose load failed (recomputed), block hashes whose tier copy
        they deleted (the disk tier's evictions: published removed, first). A step's
        synchronous loads (``kv_sync_jobs``) are reported before its output; when one of
        their blocks failed, the step is discarded (``discard_step``), not applied.
        ``ValueError`` for an id the scheduler is not waiting for."""
    def has_pending_transfers(self) -> bool:
        """Loads or saves not reported yet (their blocks stay allocated until then)."""
    def get_stats(self) -> dict[str, int | float]: ...
    def check_invariants(self) -> None: ...
    def set_kv_groups(self, windows: list[int | None]) -> None:
        """Lays out the model's KV layer groups, before any request: one entry per group, its
        sliding window in tokens or None for full attention (default ``[None]``). A
        sliding-window group holds only the blocks its window reads; ``ValueError`` for a
        window of 0, ``PagedLLMError`` once requests exist or with a KV connector."""
    @property
    def kv_groups(self) -> list[int | None]: ...
    def group_block_table(self, seq_id: int, group: int) -> list[int]:
        """Layer group ``group``'s block row of sequence ``seq_id`` (-1 where its window
        released a block): the table that group's layers read."""
    def set_kv_events(self, enabled: bool) -> None:
        """Turns the KV events of the prefix cache (read with ``drain_kv_events``) and of the
        offload tier on or off (both read by ``KvEventStream.publish_step``)."""
    def drain_kv_events(
        self,
    ) -> tuple[
        _npt.NDArray[_np.uint8],
        _npt.NDArray[_np.uint32],
        _npt.NDArray[_np.uint64],
        _npt.NDArray[_np.uint64],
        _npt.NDArray[_np.uint64],
        _npt.NDArray[_np.uint32],
    ]:
        """The prefix cache's changes since the last call: ``(kinds [R], starts [R+1],
        parents [R], extra_keys [R], hashes [H], tokens [H * block_size])``; record r is kind
        0 stored / 1 removed / 2 all cleared over ``hashes[starts[r]:starts[r+1]]``."""
    def propose_drafts(
        self,
    ) -> tuple[_npt.NDArray[_np.int64], _npt.NDArray[_np.int32], _npt.NDArray[_np.int64]]:
        """N-gram drafts for every running sequence that decodes next step: ``(seq_ids [N],
        num_draft_tokens [N], draft_token_ids [sum])``, sequences without a proposal left out;
        at most ``num_speculative_tokens`` each, fewer when ``max_tokens`` or the model length
        leaves less room. ``PagedLLMError`` when speculation is off."""
    def set_drafts(
        self,
        seq_ids: _IntArray,
        num_draft_tokens: _IntArray,
        draft_token_ids: _IntArray,
    ) -> tuple[_npt.NDArray[_np.int64], _npt.NDArray[_np.int32], _npt.NDArray[_np.int64]]:
        """Drafts proposed outside the scheduler (a draft model) for the next step, in
        ``propose_drafts``'s form; kept for the sequences ``propose_drafts`` would serve, trimmed
        to their room; returns those kept. ``ValueError`` for inconsistent arrays,
        ``PagedLLMError`` when speculation is off."""
    @property
    def block_size(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def scheduling(self) -> str: ...
    @property
    def policy(self) -> str: ...
    @property
    def preemption_mode(self) -> str | None: ...

# =============================================================================================
# End of scheduler section
# =============================================================================================

# =============================================================================================
# CPU kernels (rust/src/bindings/cpu_ops.rs)
# =============================================================================================

def cpu_isa() -> tuple[str, list[str]]:
    """``(level, flags)``: the instruction-set level the CPU kernels run at (``"portable"``,
    ``"avx2"``, ``"avx512"``, ``"amx"``; the highest the processor and the OS grant, or a lower
    one forced by ``PAGEDLLM_CPU_ISA``) and the machine's detected feature flags (``"avx2"``,
    ``"fma"``, ``"avx512vnni"``, ...; ``"amx-*"`` only where Linux granted the tile state).
    Decided once per process. ``ValueError`` when ``PAGEDLLM_CPU_ISA`` is not a level or is above
    what the machine grants."""

# float32, or bfloat16 as its uint16 bits (numpy has no bfloat16: `t.view(torch.uint16).numpy()`
# shares the tensor's memory). The first float argument of a call picks the kernel; every other
# float argument must have its dtype (``TypeError`` otherwise).
_F32Array = _npt.NDArray[_np.float32]
_KernelArray = _F32Array | _npt.NDArray[_np.uint16]

def cpu_store_kvcache(
    k: _KernelArray,
    v: _KernelArray,
    k_cache: _KernelArray,
    v_cache: _KernelArray,
    slot_mapping: _npt.NDArray[_np.int64],
    kv_cache_dtype: str = "auto",
    key_feedback: _F32Array | None = None,
) -> None:
    """Write k/v ``[T, KVH, D]`` into the caches ``[blocks, block_size, KVH, D]`` at their slots
    (-1: padding row, skipped). ``ValueError`` for a slot outside the cache or mismatched shapes.
    "auto": a float cache of k's dtype, or bfloat16 (uint16 bits) under float32 k (each value
    rounded to nearest even; "bfloat16" names it too). ``kv_cache_dtype`` "int8" (int8 caches)
    / "fp8_e4m3" / "fp8_e5m2" (uint8 bits): quantized caches ``[blocks, block_size, KVH, D + 1]``,
    each row rotated and coded with its scale byte.
    ``key_feedback`` float32 ``[KVH, D, D]`` (a quantized cache): the keys' codes chosen by error
    feedback as ``kernels/reference.py``'s ``quantize_rows`` chooses them, bit for bit."""

def cpu_paged_attention(
    q: _KernelArray,
    k_cache: _KernelArray,
    v_cache: _KernelArray,
    query_start_loc: _npt.NDArray[_np.int32],
    seq_lens: _npt.NDArray[_np.int32],
    block_tables: _npt.NDArray[_np.int32],
    scale: float,
    out: _KernelArray,
    num_threads: int,
    kv_cache_dtype: str = "auto",
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Paged attention of q ``[T, H, D]`` over the caches into ``out`` (contiguous ``[T, H, D]``),
    causal within each sequence's query rows, reading the cache in place (of q's dtype, bfloat16
    under float32 q, or quantized as ``cpu_store_kvcache`` says); GIL released, at most
    ``num_threads`` threads. Computed in float32 for either dtype; a bfloat16 ``out`` is rounded
    once, at the end. ``sliding_window`` W > 0: a query sees its last W positions only (blocks
    wholly before are not read); ``softcap`` > 0: scores capped as ``softcap * tanh(s /
    softcap)``. ``ValueError`` for block ids outside the cache, a table too narrow for its
    context, or mismatched shapes."""

def cpu_rotary_in_place(x: _KernelArray, cos: _KernelArray, sin: _KernelArray) -> None:
    """Rotate the heads of ``x`` ``[T, heads, D]`` (each head contiguous, any other strides) in
    place by ``cos``/``sin`` ``[T, D / 2]``: halves (a, b) become (a*cos - b*sin, b*cos + a*sin),
    bit-identical to torch's rotate_half formula in that dtype (in bfloat16 each product and sum
    rounded as torch's bfloat16 ops round them). ``ValueError`` for an odd ``D``, tables of the
    wrong shape, or a head that is not contiguous."""

def cpu_linear(
    x: _KernelArray,
    panels: _KernelArray,
    bias: _KernelArray | None,
    out: _KernelArray,
    num_threads: int,
) -> None:
    """``out [M, N] = x [M, K] @ W.T (+ bias [N])`` with the weight ``W [N, K]`` given as its
    column panels ``[ceil(N / 16), K, 16]`` (the last zero-padded), or those in groups where
    ``cpu_panel_group`` says so; every array contiguous and of one dtype. Sums in float32 (one
    FMA chain per output in ``k`` order, so a row's result does not depend on the rows beside
    it); a bfloat16 ``out`` is rounded once. ``num_threads`` workers at most. ``ValueError`` for
    shapes that do not fit together."""

def cpu_panel_group(dtype: str, panels: int, k: int) -> int:
    """The panels per group (4, or 1: plain panels) in which ``cpu_linear`` and
    ``cpu_moe_experts`` read ``panels`` panels of ``k`` rows of ``dtype`` (``"float32"`` or
    ``"bfloat16"``) fastest here: 4 for bfloat16 where the CPU has AVX-512 BF16 (and the
    process's ISA level allows it), ``panels`` a multiple of 4 and ``k`` even. Grouped panels
    ``[P / G, K, G * 16]`` hold each group as ``[K / 2, G, 16, 2]``. ``ValueError`` for another
    dtype."""

def cpu_moe_experts(
    x: _KernelArray,
    gate_up: _KernelArray,
    down: _KernelArray,
    ids: _npt.NDArray[_np.int64],
    weights: _npt.NDArray[_np.float32],
    out: _KernelArray,
    num_threads: int,
) -> None:
    """The mixture-of-experts MLP: ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) *
    up_e(x[t]))`` with ``e = ids[t, j]``, for ``x`` ``[T, H]``, every expert's gate/up weight
    ``[2I, H]`` (gate rows, then up rows) as panels ``[E, ceil(2I / 16), H, 16]`` and down weight
    ``[H, I]`` as ``[E, ceil(H / 16), I, 16]``, int64 ids and float32 weights ``[T, k]``. Tokens
    are grouped by expert and each chosen expert's weights read once; experts no token chose are
    not read. The terms are summed in ascending expert order in float32 and ``out`` rounded once.
    ``x``, the panels and ``out`` of one dtype; all contiguous; ``num_threads`` workers at most.
    Either panel array may be in groups of ``G`` panels where ``cpu_panel_group`` says so:
    ``[E, P / G, K, G * 16]``, each group ``[K / 2, G, 16, 2]`` (the same products, read as one
    stream). An id of -1 (another expert-parallel rank's expert) adds nothing. ``ValueError``
    for another id outside ``0..E`` or shapes that do not fit together."""

class CpuMoeQuantExperts:
    """Experts kept in their GGUF types, registered once: ``buffers`` (uint8, 1-D, held, never
    written: a GGUF file's mapped expert tensors as they are, or one copy); ``gate_up[e]`` /
    ``down[e]`` are expert ``e``'s gate/up (``[2I, H]``, gate rows then up rows) and down
    (``[H, I]``) row segments as ``(ggml type code, rows, buffer index, byte offset)``;
    ``hidden`` = H; ``owners`` is kept alive as long as the experts (what owns the buffers'
    memory). ``ValueError`` for an unsupported type, shapes that do not fit together or a
    segment outside its buffer."""

    def __init__(
        self,
        buffers: _Sequence[_npt.NDArray[_np.uint8]],
        gate_up: _Sequence[_Sequence[tuple[int, int, int, int]]],
        down: _Sequence[_Sequence[tuple[int, int, int, int]]],
        hidden: int,
        owners: object = None,
    ) -> None: ...
    def run(
        self,
        x: _F32Array,
        ids: _npt.NDArray[_np.int64],
        weights: _npt.NDArray[_np.float32],
        out: _F32Array,
        num_threads: int,
        activations: str = "f32",
    ) -> None:
        """``cpu_moe_experts`` for float32 ``x`` ``[T, H]`` over these experts, the products
        multiplying x as ``activations`` says. Tokens grouped by expert, experts no token chose
        not read, terms summed in ascending expert order. ``ValueError`` for an id outside
        ``0..E`` (other than -1) or shapes that do not fit together."""

def cpu_rms_norm(x: _KernelArray, weight: _KernelArray, eps: float, out: _KernelArray) -> None:
    """``out = weight * (x * rsqrt(mean(x**2, -1) + eps))`` for every row of ``x`` ``[T, E]``,
    sums in float32 (a bfloat16 row rounded as ``weight * (x32 * r).to(bfloat16)`` rounds it);
    all arrays contiguous and of one dtype. ``ValueError`` for shapes that do not fit."""

def cpu_add_rms_norm(
    x: _KernelArray, residual: _KernelArray, weight: _KernelArray, eps: float
) -> None:
    """The residual step between two blocks, in place: ``residual += x`` (rounded to its dtype),
    then ``x = weight * (residual * rsqrt(mean(residual**2, -1) + eps))`` as ``cpu_rms_norm``
    computes it. ``x`` and ``residual`` ``[T, E]``, distinct, contiguous, of one dtype with
    ``weight`` ``[E]``. ``ValueError`` for shapes that do not fit."""

def cpu_silu_and_mul(gate_up: _KernelArray, out: _KernelArray, num_threads: int) -> None:
    """``out = silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up`` ``[T, 2I]`` (the fused
    gate/up projection's output) into ``out`` ``[T, I]``; silu is ``x / (1 + exp(-x))`` in
    float32 (within a few ulp of torch's), rounded to bfloat16 before the product in bfloat16.
    Large calls use up to ``num_threads`` threads. Both contiguous, of one dtype. ``ValueError``
    for shapes that do not fit."""

def cpu_argmax(
    logits: _npt.NDArray[_np.float32], out: _npt.NDArray[_np.int64], num_threads: int
) -> None:
    """``out[r]`` = the index of the largest value of row ``r`` of ``logits`` ``[K, V]``: the
    first on ties, the first NaN if the row holds one (``torch.argmax``'s rules); ``out``
    ``[K]``; up to ``num_threads`` threads for large calls. ``ValueError`` for shapes that do not
    fit or an empty row."""

# Quantized-weight kernels (rust/src/bindings/cpu_quant.rs): a weight `[N, K]` crosses as its
# row segments, `(ggml type code, uint8 [rows, row_bytes])` each, contiguous.
_QuantSegments = _Sequence[tuple[int, _npt.NDArray[_np.uint8]]]

def cpu_quant_block_shape(qtype: int) -> tuple[int, int]:
    """``(elements, bytes)`` of one block of ggml type ``qtype`` (F32: ``(1, 4)``, Q4_K:
    ``(256, 144)``). ``ValueError`` for a type the kernels do not take."""

def cpu_quant_linear(
    x: _F32Array,
    segments: _QuantSegments,
    bias: _F32Array | None,
    out: _F32Array,
    num_threads: int,
    activations: str = "f32",
) -> None:
    """``out [M, N] = x [M, K] @ W.T (+ bias [N])`` with ``W`` dequantized on the fly (sums in
    float32: ``x @ dequantize(W).T`` up to summation order); ``num_threads`` workers at most.
    ``activations="int8"``: up to 8 rows of x quantized to 8 bits per 32 elements (scale
    ``max|x| / 127``), multiplied by the rows of Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 with integer
    dot products, each block's sum scaled in float32; ``"int16"``: the same with 16-bit codes
    (scale ``max|x| / 32767``, rounded to nearest even) for the rows of every quantized type
    (the K-quants too). ``ValueError`` for an unsupported type or activations, bytes that are
    not whole rows, or shapes that do not fit."""

def cpu_quant_dequantize(segments: _QuantSegments, out: _F32Array) -> None:
    """The weight as float32 into ``out [N, K]``, bit for bit as ``gguf.quants.dequantize``."""

def cpu_quant_embedding(
    ids: _npt.NDArray[_np.int64], segments: _QuantSegments, out: _F32Array
) -> None:
    """Rows ``ids`` of the weight dequantized into ``out [len(ids), K]``. ``ValueError`` for an
    id outside the rows."""

def cpu_quant_quantize(weight: _F32Array, qtype: int, out: _npt.NDArray[_np.uint8]) -> None:
    """``weight [N, K]`` quantized to Q8_0 or Q4_0 into ``out [N, row_bytes]`` with ggml's
    reference rounding (byte for byte as ``gguf.quants.quantize``)."""

def cpu_quant_repack(
    qtype: int, src: _npt.NDArray[_np.uint8], in_features: int, out: _npt.NDArray[_np.uint8]
) -> int | None:
    """Rows ``src [rows, row_bytes]`` of ggml type ``qtype`` written into ``out`` (as many bytes)
    in the layout this process's products read fastest, returning that layout's type code (at
    AVX-512 with VNNI: Q4_0 1002, repacked Q4_0; Q5_0 1006, repacked Q5_0; Q8_0 1008, repacked
    Q8_0; Q4_1 1003, repacked Q4_1); ``None``, ``out``
    untouched, where the type stays
    as it is. ``ValueError`` for sizes that are not the same whole rows."""

class CpuDecoder:
    """A decoder's layer weights (numpy arrays, held once) for ``forward``: the layers and the
    final norm of a Llama / Qwen2 / Qwen3 model in one call, kernel for kernel as the Python
    layers run them (``models/cpu_forward.py``)."""

    def __init__(
        self,
        layers: list[tuple[object, ...]],
        final_norm: _KernelArray,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        key_transforms: list[tuple[_F32Array, _F32Array, _F32Array | None, _F32Array | None] | None]
        | None = None,
        ends: tuple[tuple[object, ...], tuple[object, ...]] | None = None,
    ) -> None:
        """``layers``: per layer ``(input_norm, qkv, q_norm, k_norm, o, post_norm, gate_up,
        down)``: norms ``[E]`` (``q_norm``/``k_norm`` ``[D]`` or both None), each projection
        ``("panels", [P, K, 16], out_features, bias)`` or ``("quant", segments, in_features,
        bias)`` with bias None or ``[N]``; every float array float32, or every one bfloat16
        (uint16 bits): ``final_norm``'s dtype is the activations' (quantized projections take
        float32 activations only). A mixture-of-experts layer ends ``(..., post_norm, moe,
        None)`` with ``moe`` = ``("moe", router, experts, top_k, (normalize, round_weights),
        shared, counts)``: experts ``("panels", gate_up [E, P, H, 16],
        down [E, P, I, 16])`` or ``("quant", CpuMoeQuantExperts)``, shared None or the shared
        expert's ``(gate_up, down, gate)`` projections, counts int64 ``[E]`` (each token's
        chosen experts added in place). ``key_transforms``: per layer None or a quantized
        cache's key transform ``(query_scale [H * D], key_scale [KVH * D], key_offset [KVH * D]
        or None, key_feedback [KVH * D * D] or None)`` (``attention/key_transform.py``).
        ``ends``: None, or ``(embedding, head)`` for ``logits``: the embedding ``("table",
        [V, E])`` or ``("quant", segments, in_features)``, the LM head a projection as
        above. ``TypeError`` / ``ValueError`` naming the layer and part that is not so."""

    def forward(
        self,
        x: _KernelArray,
        cos: _KernelArray,
        sin: _KernelArray,
        slot_mapping: _npt.NDArray[_np.int64],
        query_start_loc: _npt.NDArray[_np.int32],
        seq_lens: _npt.NDArray[_np.int32],
        block_tables: _npt.NDArray[_np.int32],
        kv_cache: _KernelArray | _npt.NDArray[_np.int8] | _npt.NDArray[_np.uint8],
        num_threads: int,
        activations: str = "f32",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """Every layer and the final norm over ``x [T, E]`` in place (embeddings in, hidden
        states out; ``x``, ``cos``, ``sin`` in the activations' dtype), K/V stored into
        ``kv_cache`` (the activations' dtype ``[2, L, blocks, block_size, KVH, D]``, bfloat16
        under float32 activations, or
        ``kv_cache_dtype`` "int8" (int8) / "fp8_e4m3" / "fp8_e5m2" (uint8 bits) with rows of
        ``D + 1``, as ``cpu_store_kvcache`` codes them) and attended over; ``cos``/``sin``
        ``[T, D / 2]``; ``activations`` of the quantized projections as ``cpu_quant_linear``
        takes them. ``ValueError`` naming a
        projection or array whose shape does not fit."""

    def logits(
        self,
        ids: _npt.NDArray[_np.int64],
        cos: _KernelArray,
        sin: _KernelArray,
        slot_mapping: _npt.NDArray[_np.int64],
        query_start_loc: _npt.NDArray[_np.int32],
        seq_lens: _npt.NDArray[_np.int32],
        block_tables: _npt.NDArray[_np.int32],
        kv_cache: _KernelArray | _npt.NDArray[_np.int8] | _npt.NDArray[_np.uint8],
        sample_rows: _npt.NDArray[_np.int64],
        logits: _F32Array,
        num_threads: int,
        activations: str = "f32",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``forward`` from token ids to logits: ``ids [T]`` embedded, the layers and the final
        norm run as ``forward`` runs them, then the LM head over rows ``sample_rows [K]`` of the
        hidden states into ``logits [K, V]`` float32 (a bfloat16 head's widened exactly).
        ``ValueError`` when the decoder holds no
        ``ends``, or an id or row is out of range."""

    def __len__(self) -> int: ...

class ShmAllReduce:
    """One rank's end of a sum all-reduce over one POSIX shared-memory segment (ranks on one
    host). Waits spin, yield, then sleep on a futex, with the GIL released; they fail with
    ``TimeoutError`` past ``timeout_s``, ``ConnectionError`` when a peer died or aborted (and
    this rank's failure aborts the others). After a failure every call fails."""

    @staticmethod
    def create(world_size: int, chunk_bytes: int, timeout_s: float) -> ShmAllReduce:
        """Rank 0: a new segment (``name``) for ``world_size`` ranks (2..16); tensors move in
        pieces of ``chunk_bytes`` (a multiple of 64). ``OSError`` when /dev/shm refuses."""
    @staticmethod
    def attach(name: str, rank: int, timeout_s: float) -> ShmAllReduce:
        """Rank ``rank`` (1..world_size-1): maps the segment rank 0 created."""
    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid). Idempotent."""
    def abort(self) -> None:
        """Fail every rank's current and later all-reduces at once."""
    def all_reduce_f32(self, data: _F32Array) -> None:
        """Sum the contiguous 1-D ``data`` over the ranks in place (every rank, the same call
        order and length); all ranks get bit-identical sums (added in rank order)."""
    def all_reduce_bf16(self, data: _npt.NDArray[_np.int16]) -> None:
        """The same for bfloat16 bits viewed as int16, summed in float32, rounded once."""

class ShmRingWriter:
    """The writer's end of a shared-memory broadcast ring: ``n_chunks`` chunks of
    ``chunk_bytes``, every message read by each of ``n_readers`` readers."""

    def __init__(self, n_readers: int, n_chunks: int, chunk_bytes: int) -> None: ...
    @property
    def name(self) -> str: ...
    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid). Idempotent."""
    def publish(
        self,
        tag: int,
        ints: list[int],
        arrays: list[_npt.NDArray[_np.generic] | None],
        timeout_s: float | None = None,
    ) -> bool:
        """Send a message (C-contiguous bool/uint8/int16/int32/int64/float32/float64 arrays of at
        most 4 dimensions) to every reader, waiting for a free chunk; ``False`` when it does not
        fit one chunk (nothing sent). ``TimeoutError`` naming the slow reader's rank,
        ``ConnectionError`` when a reader died while the ring was full."""

class ShmRingReader:
    """A reader's end of a broadcast ring: rank ``rank`` (1..n_readers; the writer is rank 0).
    The last reader to attach removes the ring's name from /dev/shm."""

    def __init__(self, name: str, rank: int) -> None: ...
    def receive(
        self, timeout_s: float | None = None
    ) -> tuple[int, list[int], list[_npt.NDArray[_np.generic] | None]] | None:
        """The next message (None once ``timeout_s`` passes). Its arrays are views of the ring,
        valid until ``ack()`` or the next ``receive``. ``ConnectionError`` when the writer died."""
    def ack(self) -> None:
        """Done with the last message: its chunk may be reused."""
