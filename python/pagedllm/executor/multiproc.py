"""The `mp` tensor-parallel executor: rank 0 in the engine process, ranks 1..N-1 spawned.

The Rust scheduler stays in the engine process; ranks never schedule. Each forward, rank 0
broadcasts one message to every worker through a shared-memory ring (`_core.ShmRingWriter`,
vLLM's `MessageQueue` design: written once, read in place by every worker): the block operations
since the last message and the step's arrays (`worker.StepArrays`: the numpy buffers
`ModelRunner.prepare` reads), as raw arrays, no pickling. A message larger than a ring chunk, or
one carrying the LoRA slot loads rank 0 made for the step (objects, rare), goes through each
worker's `multiprocessing` pipe instead (the ring carries a marker, so the order holds). Every
rank is a `worker.Worker` (rank 0's in the engine) running the same `ModelRunner` over its shard
and its own paged KV cache (its KV heads, the same block tables); the collectives (the
shared-memory all-reduce, gloo) run inside the model. Only rank 0 gets logits; sampling and
everything after stay in the engine. Each worker answers each message over its pipe, so a rank
that raises, dies or hangs is known at the step it fails. The processes' life (spawned tied to
the engine, answers watched beside their sentinels, a watch thread between steps, stop then
kill) is `supervisor.ProcessSupervisor`'s.

Failure: a worker's death is seen from its process sentinel, waited on beside its answer during
a step and by a watch thread between steps (an idle engine is dead, and its health says so, within
moments of the death; `on_death` callbacks are told). A worker that does not answer a step within
`tp_step_timeout` is declared hung: the collectives share the timeout, and once rank 0's own
forward failed in one (it waited for the frozen rank for that long already) only what is left of
the step's bound is waited, so a frozen rank is declared dead after `tp_step_timeout`, not twice
that. Either makes the executor dead: this step and every later one raise `RankDiedError`
naming the rank. A worker dies with its engine at any moment of its life (`lifeline.Tie`: a watch
from its first instruction, then the kernel's parent-death signal; in steps it also sees rank 0's
death from the ring). `shutdown()` (also at exit) stops and joins every worker. The ring's name
leaves /dev/shm once every worker has mapped it, before the group forms and the shards load (and
at shutdown, or by a worker whose engine died before it mapped it); what an engine killed in the
moments between leaves, the next start removes (`distributed/shm_names.py`).

Start-up (spawning, meeting, loading the shards, allocating the KV cache) has its own, longer
bound, `EngineArgs.tp_startup_timeout`: a worker that dies meanwhile still fails it at once. Rank 0
owns the rendezvous: it opens the store on a port the OS gives it before spawning the workers.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing import get_context

import numpy as np
import torch

from pagedllm._core import ShmRingReader, ShmRingWriter
from pagedllm.config import EngineArgs
from pagedllm.distributed import parallel_state
from pagedllm.distributed.shm_names import remove_stale_segments
from pagedllm.executor.base import FAILED_STEP_GRACE_S, join_as_rank, join_as_rank_zero
from pagedllm.executor.errors import EngineDeadError, RankDiedError
from pagedllm.executor.lifeline import Tie
from pagedllm.executor.supervisor import ChildFailed, ProcessSupervisor
from pagedllm.worker.worker import STEP_ARRAYS, STEP_FIELDS, StepArrays, StepMessage

__all__ = ["STEP_FIELDS", "EngineDeadError", "MultiprocExecutor", "StepArrays", "decode_step"]

logger = logging.getLogger("pagedllm.executor")

# seconds a worker is given to exit on its own at shutdown before it is terminated
JOIN_TIMEOUT_S = 5.0
# the broadcast ring: rank 0 waits for every answer before it sends again, so two chunks never
# run out; a chunk holds a step of 16k tokens with its block tables
RING_CHUNKS = 2
RING_CHUNK_BYTES = 4 << 20
# the ring's message tags
TAG_STEP, TAG_CACHE, TAG_SHUTDOWN, TAG_PIPE = range(4)


def _encode(message) -> tuple[int, list[int], list] | None:
    """A message (`("step", *StepMessage)`, `("cache", gpu, cpu)`, `("shutdown",)`) as the
    ring's (tag, ints, arrays); None: it must go through the pipes."""
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
        items += [np.ascontiguousarray(getattr(arrays, name)) for name in STEP_ARRAYS]
    if prompt_rows is not None:
        items.append(np.ascontiguousarray(prompt_rows))
    return TAG_STEP, ints, items


def decode_step(ints: list[int], items: list) -> StepMessage:
    """A step message's (block_ops, arrays, prompt_rows), the arrays views of the ring."""
    num_ops, has_arrays, has_prompt = ints[:3]
    block_ops = [tuple(items[3 * i : 3 * i + 3]) for i in range(num_ops)]
    at = 3 * num_ops
    arrays = None
    if has_arrays:
        fields = dict(zip(STEP_ARRAYS, items[at : at + len(STEP_ARRAYS)], strict=True))
        arrays = StepArrays(**fields, is_decode_only=bool(ints[3]), num_seqs=ints[4])
        at += len(STEP_ARRAYS)
    return StepMessage(block_ops, arrays, items[at] if has_prompt else None)


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
        conn.send(("mapped",))  # so the engine unlinks its name now, not after the load
        worker = join_as_rank(rank, args, dtype, rendezvous)
        conn.send(("loaded",))
        tag, ints, _ = ring.receive()
        ring.ack()
        if tag != TAG_CACHE:
            return  # shut down before the cache was planned
        worker.init_cache(*ints)
        conn.send(("ready",))
        while True:
            tag, ints, items = ring.receive()  # waits for ever; ConnectionError: engine died
            if tag == TAG_SHUTDOWN:
                break
            # a step that outgrew a chunk comes down the pipe as ("step", *StepMessage)
            piped = tag == TAG_PIPE
            message = StepMessage(*conn.recv()[1:]) if piped else decode_step(ints, items)
            worker.execute(message)
            del message, items  # views of the chunk: gone before the ack
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


def _rank_label(rank: int) -> str:
    return f"tensor-parallel rank {rank}"


class MultiprocExecutor:
    """Spawns ranks 1..N-1 and joins the group as rank 0 (in this process)."""

    def __init__(self, args: EngineArgs, dtype: torch.dtype) -> None:
        self.size = args.tensor_parallel_size
        self.timeout_s = args.tp_step_timeout
        self.startup_timeout_s = args.tp_startup_timeout
        self.dead: str | None = None  # why the executor can run no more steps
        # called (from the watch thread) with the reason when a worker dies between steps
        self.on_death: list[Callable[[str], None]] = []
        self._deadline = 0.0  # the running step's bound (monotonic seconds)
        self.pipe_messages = 0  # messages that outgrew a ring chunk and went through the pipes
        # the rendezvous' port is ours from here on: engines started side by side never collide
        store = parallel_state.open_rendezvous(self.size, self.startup_timeout_s)
        rendezvous = parallel_state.Rendezvous("127.0.0.1", store.port)
        self.workers = ProcessSupervisor(_rank_label, "pagedllm-tp", get_context("spawn"))
        remove_stale_segments()  # what engines killed before their ranks mapped them left
        self.ring = ShmRingWriter(self.size - 1, RING_CHUNKS, RING_CHUNK_BYTES)
        # at exit, even if the engine is never shut down (a weak reference: no cycle kept alive)
        ref = weakref.ref(self)
        self._atexit = lambda: (executor := ref()) is not None and executor.shutdown()
        atexit.register(self._atexit)
        try:
            # until a worker maps the ring, it removes the ring's name if this process dies
            tie = Tie.to_this_process(orphan_names=(self.ring.name,))
            for rank in range(1, self.size):
                work = (rank, args, dtype, rendezvous, self.ring.name)
                self.workers.spawn(tie, _worker_main, work)
            # every worker has it mapped (and no longer removes it if this process dies): the
            # name goes now, not after the shards load, so a kill meanwhile leaves nothing
            self._expect("mapped", self.startup_timeout_s)
            self.ring.unlink()
            self._join_group(store)
            self._expect("loaded", self.startup_timeout_s)
            self.workers.watch(self, MultiprocExecutor._mark_dead)
        except BaseException:
            # also when a spawn fails: the workers started so far and the ring's name go
            self.shutdown()
            raise

    @property
    def procs(self) -> list:
        """The workers' processes, rank 1 first."""
        return self.workers.procs

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

        def watch() -> None:
            self._guard(self._raise_first_death)

        join_as_rank_zero(self.size, store, self.timeout_s, self.startup_timeout_s, watch)

    def _raise_first_death(self) -> None:
        failure = self.workers.first_death(0.05)
        if failure is not None:
            raise failure

    def start_workers(self, num_gpu_blocks: int, num_cpu_blocks: int, rank_zero):
        """Give the workers the cache size rank 0 planned (every rank holds as many blocks);
        rank 0 allocates its own meanwhile."""
        self._send(("cache", num_gpu_blocks, num_cpu_blocks))
        local = rank_zero(num_gpu_blocks, num_cpu_blocks)
        self._expect("ready", self.startup_timeout_s)
        return local

    # ---- messages -----------------------------------------------------------------------------

    def _send(self, message) -> None:
        """Broadcast `message` through the ring, or its pipes when it outgrows a chunk."""
        self.check_health()
        try:
            encoded = _encode(message)
            if encoded is not None and self.ring.publish(*encoded, self.timeout_s):
                return
            self.ring.publish(TAG_PIPE, [], [], self.timeout_s)
            self.pipe_messages += 1
        except (TimeoutError, ConnectionError) as exc:
            self._die(f"tensor-parallel {exc}")
        self._guard(self.workers.send, message)

    def _expect(self, kind: str, timeout_s: float, wait_s: float | None = None) -> None:
        """Wait for every worker's answer `kind`; a death, an error or silence for `timeout_s`
        (or `wait_s` in all, when given: what is left of the step's bound) kills."""
        bound = "tp_step_timeout" if kind == "ok" else "the start-up timeout"
        self._guard(self.workers.expect, kind, timeout_s, bound, wait_s)

    def _guard(self, call, *args) -> None:
        """`call(*args)`; a worker's failure there kills (`_die` runs outside the handler, so
        the error a step is failing with, if any, stays the context of `RankDiedError`)."""
        try:
            call(*args)
            return
        except ChildFailed as failure:
            reason = failure.reason
        self._die(reason)

    def check_health(self) -> None:
        """RankDiedError when a worker died (seen now or by the watch thread) or the executor is
        dead already."""
        if self.dead is not None:
            if self.procs:  # the watch thread saw the death: the other workers go now
                self.shutdown()
            raise RankDiedError(self.dead)
        self._guard(self.workers.check_alive)

    def _die(self, reason: str):
        self.dead = reason
        self.shutdown()
        raise RankDiedError(reason)

    def broadcast_step(self, message: StepMessage) -> None:
        self._deadline = time.monotonic() + self.timeout_s
        self._send(("step", *message))

    def collect(self, rank_zero_failed: bool = False) -> None:
        """The workers' answers to the step. Also after rank 0's own forward failed
        (`rank_zero_failed`): a collective that failed because a worker did is reported as that
        worker's failure, and only what is left of the step's bound is waited (at least
        `FAILED_STEP_GRACE_S`): a collective that timed out waited for the frozen rank already."""
        self.check_health()
        wait_s = None
        if rank_zero_failed:
            wait_s = max(self._deadline - time.monotonic(), FAILED_STEP_GRACE_S)
        self._expect("ok", self.timeout_s, wait_s)

    # ---- shutdown -----------------------------------------------------------------------------

    def __del__(self) -> None:
        # the engine (an `LLM`) dropped without shutdown(): its workers go with it
        workers = getattr(self, "workers", None)
        if workers is not None and workers.procs:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop every worker and leave the group. Idempotent. Healthy workers are asked to stop
        first; after a failure (a rank may be hung) they are killed at once."""
        atexit.unregister(self._atexit)
        self.workers.end_watch()  # their exits from here on are no deaths
        healthy = self.dead is None
        if healthy and self.procs:
            with contextlib.suppress(TimeoutError, ConnectionError):
                self.ring.publish(*_encode(("shutdown",)), JOIN_TIMEOUT_S)
        self.workers.stop(JOIN_TIMEOUT_S if healthy else None)
        self.ring.unlink()  # a worker that died before mapping it left the name
        parallel_state.destroy_tensor_parallel()
        if healthy:
            self.dead = "the engine was shut down"
