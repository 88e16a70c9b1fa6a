"""The `mp` tensor-parallel executor: rank 0 in the engine process, ranks 1..N-1 spawned.

The Rust scheduler stays in the engine process; ranks never schedule. Each forward, rank 0
broadcasts one message to every worker through a shared-memory ring (`_core.ShmRingWriter`,
vLLM's `MessageQueue` design: written once, read in place by every worker): the block operations
since the last message and the step's arrays (`StepArrays`: the numpy buffers
`ModelRunner.prepare` reads), as raw arrays, no pickling. A message larger than a ring chunk, or
one carrying the LoRA slot loads rank 0 made for the step (objects, rare), goes through each
worker's `multiprocessing` pipe instead (the ring carries a marker, so the order holds). Every
rank then runs the same `ModelRunner` over its shard and its own paged KV cache (its KV heads,
the same block tables); the collectives (the shared-memory all-reduce, gloo) run inside the
model. Only rank 0 gets logits; sampling and everything after stay in the engine.
Each worker answers each message over its pipe, so a rank that raises, dies or hangs is known at
the step it fails. `RankWorker` is a worker's share of a step, whatever carried it (the `ray`
launcher's actors run it too).

Failure: a worker's death is seen from its process sentinel, waited on beside its answer during
a step and by a watch thread between steps (an idle engine is dead, and its health says so, within
moments of the death; `on_death` callbacks are told). A worker that does not answer a step within
`tp_step_timeout` is declared hung: the collectives share the timeout, and once rank 0's own
forward failed in one (it waited for the frozen rank for that long already) only what is left of
the step's bound is waited, so a frozen rank is declared dead after `tp_step_timeout`, not twice
that. Either makes the executor dead: this step and every later one raise `EngineDeadError`
naming the rank. A worker dies with its engine at any moment of its life (`lifeline.Tie`: a watch
from its first instruction, then the kernel's parent-death signal; in steps it also sees rank 0's
death from the ring). `shutdown()` (also at exit) stops and joins every worker. The ring's name
leaves /dev/shm once every worker has mapped it (and at shutdown, or by a worker whose engine died
before it mapped it).

Start-up (spawning, meeting, loading the shards, allocating the KV cache) has its own, longer
bound, `EngineArgs.tp_startup_timeout`: a worker that dies meanwhile still fails it at once. Rank 0
owns the rendezvous: it opens the store on a port the OS gives it before spawning the workers.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, get_context
from typing import NamedTuple

import numpy as np
import torch

from pagedllm._core import ShmRingReader, ShmRingWriter
from pagedllm.config import EngineArgs
from pagedllm.distributed import parallel_state
from pagedllm.distributed.layers import TPShard
from pagedllm.executor.lifeline import Tie, run_tied
from pagedllm.models import load_model
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm.executor")

# the step fields `ModelRunner.prepare` reads (a scheduler step, or a `StepRows` group of one)
STEP_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_tables",
    "num_tokens",
    "is_decode_only",
    "sample_rows",
    "spec_draft_token_ids",
    "spec_num_draft_tokens",
    "lora_ids",
    "num_seqs",
)
# the fields that travel as arrays (the others are a bool and an int)
ARRAY_FIELDS = tuple(name for name in STEP_FIELDS if name not in ("is_decode_only", "num_seqs"))
# seconds a worker is given to exit on its own at shutdown before it is terminated
JOIN_TIMEOUT_S = 5.0
# after rank 0's own forward failed past the step's bound, seconds still given to the workers'
# answers (one that failed and aborted the collective sends its error at once)
FAILED_STEP_GRACE_S = 0.5
# the broadcast ring: rank 0 waits for every answer before it sends again, so two chunks never
# run out; a chunk holds a step of 16k tokens with its block tables
RING_CHUNKS = 2
RING_CHUNK_BYTES = 4 << 20
# the ring's message tags
TAG_STEP, TAG_CACHE, TAG_SHUTDOWN, TAG_PIPE = range(4)


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the engine cannot run another step."""


@dataclass
class StepArrays:
    """A step's inputs as plain arrays (what travels to the workers)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    num_tokens: np.ndarray
    is_decode_only: bool
    sample_rows: np.ndarray
    spec_draft_token_ids: np.ndarray
    spec_num_draft_tokens: np.ndarray
    lora_ids: np.ndarray
    num_seqs: int
    # LoRA: (slot, LoRARequest) of rank 0's slot loads since the last step, for the workers
    lora_loads: tuple = ()

    @classmethod
    def of(cls, step) -> StepArrays:
        return cls(**{name: getattr(step, name) for name in STEP_FIELDS})


def _block_ops(step) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    ops = (step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)
    return ops if any(len(op) for op in ops) else None


class _DiscardPromptRows:
    """A worker's stand-in for `PromptRows`: it runs the same logits slices (the LM head is a
    collective) and drops them (only rank 0 gets logits)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def take(self, logits, start: int) -> None:
        pass


class RankWorker:
    """One worker rank (1..N-1): its group membership, shard, KV cache and runner. The `mp`
    worker process and the `ray` actor both run one; what carries the messages differs."""

    def __init__(
        self,
        rank: int,
        args: EngineArgs,
        dtype: torch.dtype,
        rendezvous: parallel_state.Rendezvous,
    ) -> None:
        """Join the group (blocks until every rank has) and load this rank's shard."""
        self.args, self.dtype = args, dtype
        self.device = torch.device("cpu")
        self.tp = TPShard(rank, args.tensor_parallel_size)
        parallel_state.init_tensor_parallel(
            rank,
            self.tp.size,
            rendezvous,
            device=self.device,
            timeout_s=args.tp_step_timeout,
            startup_timeout_s=args.tp_startup_timeout,
        )
        self.model = load_model(
            args.model,
            dtype=dtype,
            device=self.device,
            tp=self.tp,
            pack_for_cpu=True,
            quantization=args.quantization,
        )
        self.lora = None
        if args.enable_lora:  # this rank's shard of the adapters rank 0 puts in slots
            from pagedllm.lora.manager import LoRAManager

            self.lora = LoRAManager(
                self.model,
                max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.resolved_max_cpu_loras,
                dtype=dtype,
                device=self.device,
            )

    def allocate(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The KV cache rank 0 planned (every rank holds as many blocks) and the runner."""
        cfg = self.model.config
        self.cache = CacheEngine(
            num_layers=cfg.num_layers,
            num_kv_heads=self.tp.kv_heads(cfg.num_kv_heads),
            head_dim=cfg.head_dim,
            block_size=self.args.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            dtype=self.dtype,
            device=self.device,
            kv_cache_dtype=self.args.kv_cache_dtype,
        )
        self.runner = ModelRunner(
            self.model,
            self.cache,
            self.device,
            self.lora,
            cpu_threads=self.args.cpu_threads,
        )

    def execute(self, block_ops: list, arrays: StepArrays | None, prompt_rows) -> None:
        """One message of rank 0's: its block operations, then its forward (if any)."""
        for ops in block_ops:
            self.cache.execute(*ops)
        if arrays is not None:
            if arrays.lora_loads:
                self.lora.place(arrays.lora_loads)
            prompt = _DiscardPromptRows(prompt_rows) if prompt_rows is not None else None
            self.runner.forward(self.runner.prepare(arrays), prompt)


def _encode(message) -> tuple[int, list[int], list] | None:
    """A message as the ring's (tag, ints, arrays); None: it must go through the pipes."""
    if message[0] == "cache":
        return TAG_CACHE, [message[1], message[2]], []
    if message[0] == "shutdown":
        return TAG_SHUTDOWN, [], []
    _, block_ops, arrays, prompt_rows = message
    if arrays is not None and arrays.lora_loads:
        return None  # adapter requests are objects: the pipes carry this step
    items = [np.ascontiguousarray(op) for ops in block_ops for op in ops]
    ints = [len(block_ops), arrays is not None, prompt_rows is not None]
    if arrays is not None:
        ints += [bool(arrays.is_decode_only), int(arrays.num_seqs)]
        items += [np.ascontiguousarray(getattr(arrays, name)) for name in ARRAY_FIELDS]
    if prompt_rows is not None:
        items.append(np.ascontiguousarray(prompt_rows))
    return TAG_STEP, ints, items


def decode_step(ints: list[int], items: list) -> tuple[list, StepArrays | None, np.ndarray | None]:
    """A step message's (block_ops, arrays, prompt_rows), the arrays views of the ring."""
    num_ops, has_arrays, has_prompt = ints[:3]
    block_ops = [tuple(items[3 * i : 3 * i + 3]) for i in range(num_ops)]
    at = 3 * num_ops
    arrays = None
    if has_arrays:
        fields = dict(zip(ARRAY_FIELDS, items[at : at + len(ARRAY_FIELDS)], strict=True))
        arrays = StepArrays(**fields, is_decode_only=bool(ints[3]), num_seqs=ints[4])
        at += len(ARRAY_FIELDS)
    return block_ops, arrays, items[at] if has_prompt else None


def _worker_main(
    rank: int,
    args: EngineArgs,
    dtype: torch.dtype,
    rendezvous: parallel_state.Rendezvous,
    ring_name: str,
    tie: Tie,
    conn,
) -> None:
    """Rank `rank`'s process (started by `lifeline.run_tied`): map the ring, join the group, load
    its shard, then run messages until told to stop (or the engine dies). An error is sent back,
    then the worker exits."""
    try:
        ring = ShmRingReader(ring_name, rank)
        tie.hold()  # the ring is mapped: the kernel may kill this worker with its engine now
        worker = RankWorker(rank, args, dtype, rendezvous)
        conn.send(("loaded",))
        tag, ints, _ = ring.receive()
        ring.ack()
        if tag != TAG_CACHE:
            return  # shut down before the cache was planned
        worker.allocate(*ints)
        conn.send(("ready",))
        while True:
            tag, ints, items = ring.receive()  # waits for ever; ConnectionError: engine died
            if tag == TAG_SHUTDOWN:
                break
            if tag == TAG_PIPE:
                _, block_ops, arrays, prompt_rows = conn.recv()
            else:
                block_ops, arrays, prompt_rows = decode_step(ints, items)
            worker.execute(block_ops, arrays, prompt_rows)
            del block_ops, arrays, prompt_rows, items  # views of the chunk: gone before the ack
            ring.ack()
            conn.send(("ok",))
    except (EOFError, ConnectionError):
        pass  # the engine is gone
    except BaseException:
        parallel_state.abort()  # rank 0 may be waiting for this rank inside a collective
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        parallel_state.destroy_tensor_parallel()


def join_as_rank_zero(size: int, store, timeout_s: float, startup_timeout_s: float, watch) -> None:
    """Join the group as rank 0 on a thread while `watch()` (called every ~50 ms, it waits that
    long itself) checks the other ranks: one that fails or dies before it joins raises from
    `watch` at once, not when the rendezvous times out. Both launchers start this way."""
    failed: list[BaseException] = []

    def join() -> None:
        try:
            parallel_state.init_tensor_parallel(
                0,
                size,
                store,
                device=torch.device("cpu"),
                timeout_s=timeout_s,
                startup_timeout_s=startup_timeout_s,
            )
        except BaseException as exc:
            failed.append(exc)

    joiner = threading.Thread(target=join, name="pagedllm-tp-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        watch()
    if failed:
        raise failed[0]


class MultiprocExecutor:
    """Spawns ranks 1..N-1 and joins the group as rank 0 (in this process)."""

    def __init__(self, args: EngineArgs, dtype: torch.dtype) -> None:
        self.size = args.tensor_parallel_size
        self.timeout_s = args.tp_step_timeout
        self.startup_timeout_s = args.tp_startup_timeout
        self.shard = TPShard(0, self.size)
        self.dead: str | None = None  # why the executor can run no more steps
        # called (from the watch thread) with the reason when a worker dies between steps
        self.on_death: list[Callable[[str], None]] = []
        self._deadline = 0.0  # the running step's bound (monotonic seconds)
        self._watcher: threading.Thread | None = None
        self._stop_watch: tuple[int, int] | None = None  # the watch thread's wake-up pipe
        self.pipe_messages = 0  # messages that outgrew a ring chunk and went through the pipes
        # the rendezvous' port is ours from here on: engines started side by side never collide
        store = parallel_state.open_rendezvous(self.size, self.startup_timeout_s)
        rendezvous = parallel_state.Rendezvous("127.0.0.1", store.port)
        context = get_context("spawn")
        self.procs, self.conns = [], []
        self.ring = ShmRingWriter(self.size - 1, RING_CHUNKS, RING_CHUNK_BYTES)
        # at exit, even if the engine is never shut down (a weak reference: no cycle kept alive)
        ref = weakref.ref(self)
        self._atexit = lambda: (executor := ref()) is not None and executor.shutdown()
        atexit.register(self._atexit)
        try:
            # until a worker maps the ring, it removes the ring's name if this process dies
            tie = Tie.to_this_process(orphan_names=(self.ring.name,))
            for rank in range(1, self.size):
                ours, theirs = context.Pipe()
                work = (_worker_main, (rank, args, dtype, rendezvous, self.ring.name))
                proc = context.Process(
                    target=run_tied,
                    args=(tie, pickle.dumps(work), theirs),
                    name=f"pagedllm-tp{rank}",
                    daemon=True,
                )
                proc.start()
                theirs.close()  # so the worker's death reads as EOF here
                self.procs.append(proc)
                self.conns.append(ours)
            self._join_group(store)
            self._expect("loaded", self.startup_timeout_s)
            self.ring.unlink()  # every worker has it mapped
            self._start_watch()
        except BaseException:
            # also when a spawn fails: the workers started so far and the ring's name go
            self.shutdown()
            raise

    def _start_watch(self) -> None:
        """The thread that sees a worker die between steps (weakly tied: dropping the executor
        still shuts it down)."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        self._stop_watch = os.pipe()
        self._watcher = threading.Thread(
            target=_watch_workers,
            args=(weakref.ref(self), sentinels, self._stop_watch[0]),
            name="pagedllm-tp-watch",
            daemon=True,
        )
        self._watcher.start()

    def _mark_dead(self, reason: str) -> None:
        """From the watch thread: dead from now on (the next step raises and shuts down), and
        the `on_death` callbacks are told."""
        if self.dead is not None:
            return
        self.dead = reason
        for callback in self.on_death:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - a listener's bug must not hide the death
                logger.exception("an on_death callback failed")

    def _join_group(self, store) -> None:
        """Join as rank 0 while watching the workers' process sentinels."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}

        def watch() -> None:
            for sentinel in connection.wait(list(sentinels), timeout=0.05):
                self._die(self._death(sentinels[sentinel]))

        join_as_rank_zero(self.size, store, self.timeout_s, self.startup_timeout_s, watch)

    def start_workers(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Give the workers the cache size rank 0 planned (every rank holds as many blocks)."""
        self._send(("cache", num_gpu_blocks, num_cpu_blocks))
        self._expect("ready", self.startup_timeout_s)

    def runner(self, local: ModelRunner) -> ParallelModelRunner:
        return ParallelModelRunner(local, self)

    # ---- messages -----------------------------------------------------------------------------

    def _send(self, message) -> None:
        """Broadcast `message` through the ring, or its pipes when it outgrows a chunk."""
        self._check_alive()
        try:
            encoded = _encode(message)
            if encoded is not None and self.ring.publish(*encoded, self.timeout_s):
                return
            self.ring.publish(TAG_PIPE, [], [], self.timeout_s)
            self.pipe_messages += 1
        except (TimeoutError, ConnectionError) as exc:
            self._die(f"tensor-parallel {exc}")
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except OSError as exc:
                self._die(f"tensor-parallel rank {rank} is unreachable ({exc})")

    def _expect(self, kind: str, timeout_s: float, wait_s: float | None = None) -> None:
        """Wait for every worker's answer `kind`; a death, an error or silence for `timeout_s`
        (or `wait_s` in all, when given: what is left of the step's bound) kills."""
        pending = dict(enumerate(self.conns, start=1))
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while pending:
            left = timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([*pending.values(), *sentinels], timeout=left)
            if not ready:
                bound = "tp_step_timeout" if kind == "ok" else "the start-up timeout"
                self._die(
                    f"tensor-parallel rank {min(pending)} did not answer within "
                    f"{bound} ({timeout_s:g}s)"
                )
            for rank, conn in list(pending.items()):
                if conn in ready:
                    self._answer(rank, conn, kind)
                    del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending:
                    self._die(self._death(rank))

    def _answer(self, rank: int, conn, kind: str) -> None:
        try:
            answer = conn.recv()
        except (EOFError, OSError):
            self._die(self._death(rank))
        if answer[0] == "error":
            self._die(f"tensor-parallel rank {rank} failed:\n{answer[1]}")
        if answer[0] != kind:
            self._die(f"tensor-parallel rank {rank} answered {answer[0]!r}, expected {kind!r}")

    def _death(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        proc.join(timeout=1.0)
        return f"tensor-parallel rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})"

    def _check_alive(self) -> None:
        if self.dead is not None:
            if self.procs:  # the watch thread saw the death: the other workers go now
                self.shutdown()
            raise EngineDeadError(self.dead)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                self._die(self._death(rank))

    def _die(self, reason: str):
        self.dead = reason
        self.shutdown()
        raise EngineDeadError(reason)

    def step(self, block_ops: list, arrays: StepArrays | None, prompt_rows) -> None:
        self._deadline = time.monotonic() + self.timeout_s
        self._send(("step", block_ops, arrays, prompt_rows))

    def wait_step(self, rank_zero_failed: bool = False) -> None:
        """The workers' answers to the step. Also after rank 0's own forward failed
        (`rank_zero_failed`): a collective that failed because a worker did is reported as that
        worker's failure, and only what is left of the step's bound is waited (at least
        `FAILED_STEP_GRACE_S`): a collective that timed out waited for the frozen rank already."""
        self._check_alive()
        wait_s = None
        if rank_zero_failed:
            wait_s = max(self._deadline - time.monotonic(), FAILED_STEP_GRACE_S)
        self._expect("ok", self.timeout_s, wait_s)

    # ---- shutdown -----------------------------------------------------------------------------

    def __del__(self) -> None:
        # the engine (an `LLM`) dropped without shutdown(): its workers go with it
        if getattr(self, "procs", None):
            self.shutdown()

    def shutdown(self) -> None:
        """Stop every worker and leave the group. Idempotent. Healthy workers are asked to stop
        first; after a failure (a rank may be hung) they are killed at once."""
        atexit.unregister(self._atexit)
        self._end_watch()
        healthy = self.dead is None
        if healthy and self.procs:
            with contextlib.suppress(TimeoutError, ConnectionError):
                self.ring.publish(*_encode(("shutdown",)), JOIN_TIMEOUT_S)
        for proc in self.procs:
            if healthy:
                proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.procs = []
        self.ring.unlink()  # a worker that died before mapping it left the name
        parallel_state.destroy_tensor_parallel()
        if healthy:
            self.dead = "the engine was shut down"

    def _end_watch(self) -> None:
        """Stop the watch thread before the workers are stopped (their exits are no deaths)."""
        if self._stop_watch is None:
            return
        wake, self._stop_watch = self._stop_watch, None
        os.close(wake[1])  # the thread reads EOF and returns
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        os.close(wake[0])


def _watch_workers(ref: weakref.ref, sentinels: dict, stop_fd: int) -> None:
    """The watch thread: waits for a worker's death (its sentinel) or for `stop_fd`'s EOF."""
    ready = connection.wait([*sentinels, stop_fd])
    dead = sorted(sentinels[sentinel] for sentinel in ready if sentinel in sentinels)
    executor = ref()
    if executor is None or stop_fd in ready or not dead:
        return
    executor._mark_dead(executor._death(dead[0]))


class ParallelInputs(NamedTuple):
    """A forward's inputs on rank 0: the arrays the workers get, and rank 0's own tensors (what
    `ModelRunner.prepare` returns; a rank-0-only draft model runs on these)."""

    arrays: StepArrays
    local: tuple


class ParallelModelRunner:
    """Rank 0's runner: `ModelRunner`'s interface, every call mirrored on the workers.

    Block operations are run here at once and sent with the next forward (workers run them in
    the same order before it; nothing reads their cache in between)."""

    def __init__(self, local: ModelRunner, executor: MultiprocExecutor) -> None:
        self.local = local
        self.executor = executor
        self.model = local.model
        self.cache_engine = local.cache_engine
        self.device = local.device
        self.cpu_threads = local.cpu_threads
        self.lora = None
        self._block_ops: list = []

    def execute_block_ops(self, step) -> None:
        self.local.execute_block_ops(step)
        ops = _block_ops(step)
        if ops is not None:
            self._block_ops.append(ops)

    def prepare_step(self, step):
        self.execute_block_ops(step)
        if step.num_seqs == 0:
            return None
        return self.prepare(step)

    def prepare(self, step) -> ParallelInputs:
        arrays = StepArrays.of(step)
        if self.local.lora is not None:
            arrays.lora_loads = tuple(self.local.lora.take_loads())
        return ParallelInputs(arrays, self.local.prepare(arrays))

    def forward(self, inputs, prompt=None) -> torch.Tensor | None:
        arrays, local_inputs = inputs
        block_ops, self._block_ops = self._block_ops, []
        self.executor.step(block_ops, arrays, None if prompt is None else prompt.rows)
        try:
            logits = self.local.forward(local_inputs, prompt)
        except BaseException:
            # the ranks are out of step now: EngineDeadError (a worker's death, error or
            # silence), with rank 0's error as its context
            self.executor.wait_step(rank_zero_failed=True)
            raise
        self.executor.wait_step()
        return logits
