"""The worker half of the native offload tier: runs each step's loads and saves (from the
step's `kv_load_*` / `kv_save_*` arrays) on a copy thread and reports finished transfers.

- `start_load_kv(step)`: right after `schedule()`, before anything of the step can fail
  (the scheduler holds the blocks until each transfer is reported, so every one must run);
  the copy thread runs saves first, in order, then asynchronous loads. The step's
  synchronous loads (`kv_sync_jobs`: the host tier's) are copied in on the calling thread
  before it returns, ahead of the forward (all layers at once: vLLM's per-layer
  `wait_for_layer_load` would only overlap them with the first layers), and it returns their
  (jobs, failed device blocks) for the engine to report at once. They may overtake the copy
  thread's saves: a save reads blocks held until it is reported and writes a slot no load
  reads, a load reads a slot whose save was reported and writes a fresh block.
- `get_finished()`: (finished loads, finished saves, device blocks whose load failed, block
  hashes whose tier copy a save deleted), the scheduler's `update_connector_output` arguments
  (vLLM's `get_finished`, plus the disk tier's evictions).
- `wait_for_save()`: blocks until every transfer submitted so far is done.

Asynchronous loads (the disk tier's) run on the copy thread: the scheduler parks the
request until they are reported. Saves read blocks the forwards already wrote, so no layer
waits on them (`save_kv_layer` has nothing to do here). A load whose slot no longer holds the
block hash the scheduler expects (a corrupted or overwritten entry) is not copied and is
reported as failed: those tokens are computed again. A transfer that raises never stalls the
scheduler: a save is reported all the same (its blocks released, nothing saved), a load fails
every block it was to load.

On CPU the copy thread overlaps the copies with the forward (torch releases the GIL). On
CUDA the pool is pinned and the copy thread's copies run on a side stream, ordered after the
forward that computed the saved blocks by an event, and reported once the stream has finished
them; synchronous loads are queued on the current stream, so the forward after them waits for
them (and a later step's saves, ordered after its own event, never overwrite a slot before
they have read it).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pagedllm.kernels.reference import as_bytes
from pagedllm.kv_transfer.host_pool import HostKVPool

logger = logging.getLogger("pagedllm")


def gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Device blocks of every layer as [k, 2, layers, block_size, kv_heads, head_dim] (the
    pool's slot layout) from `kv_cache` [2, layers, num_blocks, block_size, kv_heads, head_dim]."""
    return kv_cache.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5)


def scatter_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
    """Writes `data` [k, 2, layers, ...] (slot layout) into device blocks `blocks`."""
    # as bytes: torch has no CPU index_copy_ for an fp8 KV cache (`kv_cache_dtype`)
    as_bytes(kv_cache).index_copy_(2, blocks, as_bytes(data).permute(1, 2, 0, 3, 4, 5))


def copy_slots_out(pool: torch.Tensor, slots: list[int], data: torch.Tensor) -> None:
    """`data[i]` -> pool slot `slots[i]`, one contiguous copy per slot (non-blocking from a
    CUDA tensor into pinned memory)."""
    for i, slot in enumerate(slots):
        pool[slot].copy_(data[i], non_blocking=True)


def copy_slots_in(pool: torch.Tensor, slots: list[int], out: torch.Tensor) -> None:
    """Pool slots `slots` -> `out[i]`, one contiguous copy per slot."""
    for i, slot in enumerate(slots):
        out[i].copy_(pool[slot], non_blocking=True)


class LatencyHistogram:
    """Counts of load latencies per upper bound (seconds; the last bucket is +inf), and their
    sum, as a Prometheus histogram keeps them."""

    BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, float("inf"))

    def __init__(self) -> None:
        self.counts = [0] * len(self.BOUNDS)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[next(i for i, b in enumerate(self.BOUNDS) if seconds <= b)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class CopyThreadConnector:
    """The copy thread and the reports, shared by the tiers; a tier implements `_save` and
    `_load` (run on the thread, in step order) and `bytes_per_block`."""

    bytes_per_block: int

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._lock = threading.Lock()
        self._recving: list[int] = []
        self._sending: list[int] = []
        self._invalid: list[int] = []
        # block hashes whose tier copy a save deleted (the disk tier's evictions)
        self._removed: list[int] = []
        self._inflight: list[Future] = []
        self._done = threading.Condition(self._lock)
        # bytes moved each way and the loads' latencies (submitted -> copied), for the metrics
        self.bytes_loaded = 0
        self.bytes_saved = 0
        self.load_latency = LatencyHistogram()

    # ---- engine thread ------------------------------------------------------------------

    def start_load_kv(self, step) -> tuple[list[int], list[int]]:
        """Submits the step's saves and asynchronous loads to the copy thread, and copies its
        synchronous loads in; returns those loads' (jobs, failed device blocks)."""
        save_jobs = step.kv_save_jobs
        load_jobs = step.kv_load_jobs
        if not len(save_jobs) and not len(load_jobs):
            return [], []
        submitted = time.perf_counter()
        loads = (load_jobs, step.kv_load_blocks, step.kv_load_slots, step.kv_load_hashes)
        sync_jobs = step.kv_sync_jobs
        now = None
        if len(sync_jobs):
            is_sync = np.isin(load_jobs, sync_jobs)
            now = tuple(a[is_sync] for a in loads)
            loads = tuple(a[~is_sync] for a in loads)
        if len(save_jobs) or len(loads[0]):
            after = None
            if self.cuda:  # the saved blocks were written by forwards queued on the main stream
                after = torch.cuda.Event()
                after.record()
            saves = (save_jobs, step.kv_save_blocks, step.kv_save_slots, step.kv_save_hashes)
            future = self._executor.submit(self._run, saves, loads, after, submitted)
            with self._lock:
                self._inflight = [f for f in self._inflight if not f.done()] + [future]
        if now is None:
            return [], []
        return self._load_now(now, submitted)

    def _load_now(self, loads, submitted: float) -> tuple[list[int], list[int]]:
        """A step's synchronous loads, on the engine thread (on CUDA: queued on the current
        stream, ahead of the forward). A load that raises fails every block of the step's
        synchronous loads: the step is discarded and those tokens computed again."""
        received, invalid = self._load_or_fail(*loads)
        with self._lock:
            self.load_latency.observe(time.perf_counter() - submitted)
        return received, invalid

    def get_finished(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(finished loading, finished saving, invalid device blocks, block hashes whose tier
        copy a save deleted) since the last call; re-raises a copy thread's error."""
        with self._lock:
            for future in self._inflight:
                if future.done() and future.exception() is not None:
                    raise future.exception()
            out = (self._recving, self._sending, self._invalid, self._removed)
            self._recving, self._sending, self._invalid, self._removed = [], [], [], []
        return out

    def wait_for_save(self, timeout: float | None = None) -> None:
        """Waits for every transfer submitted so far."""
        with self._lock:
            pending = list(self._inflight)
        for future in pending:
            future.result(timeout)

    def wait_for_any(self, timeout: float) -> None:
        """Waits until some transfer finishes (the engine has nothing else to do)."""
        with self._done:
            if not (self._recving or self._sending):
                self._done.wait(timeout)

    def stats(self) -> dict[str, float | int | list[int]]:
        """Bytes moved each way and the loads' latency histogram (`LatencyHistogram.BOUNDS`)."""
        return {
            "kv_offload_bytes_loaded": self.bytes_loaded,
            "kv_offload_bytes_saved": self.bytes_saved,
            "kv_offload_load_latency_buckets": list(self.load_latency.counts),
            "kv_offload_load_latency_sum": self.load_latency.sum,
            "kv_offload_load_latency_count": self.load_latency.count,
        }

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    # ---- copy thread --------------------------------------------------------------------

    def _save_or_release(self, jobs, blocks, slots, hashes) -> list[int]:
        """`_save`; one that raises still reports its jobs (nothing saved), so the scheduler
        releases the device blocks it held for them."""
        try:
            return self._save(jobs, blocks, slots, hashes)
        except Exception:
            logger.exception(
                "pagedllm: a KV save to the offload tier failed; its blocks are released unsaved"
            )
            return list(dict.fromkeys(jobs.tolist()))

    def _load_or_fail(self, jobs, blocks, slots, hashes) -> tuple[list[int], list[int]]:
        """`_load`; one that raises fails every block it was to load: those tokens are
        computed again."""
        try:
            return self._load(jobs, blocks, slots, hashes)
        except Exception:
            logger.exception("pagedllm: a KV load from the offload tier failed")
            return list(dict.fromkeys(jobs.tolist())), blocks.tolist()

    def _run(self, saves, loads, after, submitted: float) -> None:
        stream = self.stream
        if stream is None:
            sent = self._save_or_release(*saves)
            received, invalid = self._load_or_fail(*loads)
        else:
            with torch.cuda.stream(stream):
                stream.wait_event(after)
                sent = self._save_or_release(*saves)
                received, invalid = self._load_or_fail(*loads)
            stream.synchronize()
        with self._done:
            if received:
                self.load_latency.observe(time.perf_counter() - submitted)
            self._sending += sent
            self._recving += received
            self._invalid += invalid
            self._done.notify_all()


class OffloadingConnector(CopyThreadConnector):
    """The native tier: blocks in a host pool, in the slots the scheduler picks."""

    def __init__(self, kv_cache: torch.Tensor, pool: HostKVPool) -> None:
        super().__init__(kv_cache)
        self.pool = pool
        self.bytes_per_block = pool.bytes_per_block

    def stats(self) -> dict[str, float | int | list[int]]:
        return {**super().stats(), "kv_offload_pool_bytes": self.pool.nbytes}

    def _save(self, jobs, blocks, slots, hashes) -> list[int]:
        if not len(jobs):
            return []
        index = torch.from_numpy(np.ascontiguousarray(blocks)).to(self.device)
        data = gather_blocks(self.kv_cache, index)
        slot_list = slots.tolist()
        if self.cuda:
            copy_slots_out(self.pool.blocks, slot_list, data)
        else:
            self.pool.blocks.index_copy_(0, torch.from_numpy(slots), data)
        self.pool.hashes[torch.from_numpy(slots)] = torch.from_numpy(hashes.view(np.int64))
        self.bytes_saved += len(slot_list) * self.bytes_per_block
        return list(dict.fromkeys(jobs.tolist()))

    def _load(self, jobs, blocks, slots, hashes) -> tuple[list[int], list[int]]:
        if not len(jobs):
            return [], []
        # an entry is loaded only while its slot holds the block the scheduler expects
        held = self.pool.hashes[torch.from_numpy(slots)].numpy()
        ok = held == hashes.view(np.int64)
        invalid = blocks[~ok].tolist()
        if ok.any():
            good_blocks, good_slots = blocks[ok], slots[ok]
            index = torch.from_numpy(np.ascontiguousarray(good_blocks)).to(self.device)
            if self.cuda:
                staging = torch.empty(
                    (len(good_slots), *self.pool.blocks.shape[1:]),
                    dtype=self.kv_cache.dtype,
                    device=self.device,
                )
                copy_slots_in(self.pool.blocks, good_slots.tolist(), staging)
            else:
                staging = self.pool.blocks.index_select(0, torch.from_numpy(good_slots))
            scatter_blocks(self.kv_cache, index, staging)
            self.bytes_loaded += len(good_slots) * self.bytes_per_block
        return list(dict.fromkeys(jobs.tolist())), invalid
