"""The `mp` tensor-parallel executor: rank 0 in the engine process, ranks 1..N-1 spawned.

The Rust scheduler stays in the engine process; ranks never schedule. Each forward, rank 0 sends
every worker one message over its own `multiprocessing` pipe: the block operations since the last
message and the step's arrays (`StepArrays`: the numpy buffers `ModelRunner.prepare` reads,
pickled, with the LoRA slot loads rank 0 made for them). Every rank then runs the same
`ModelRunner` over its shard and its own paged KV cache (its KV heads, the same block tables);
the collectives (gloo on CPU) run inside the model. Only
rank 0 gets logits; sampling and everything after stay in the engine. Each worker answers each
message, so a rank that raises, dies or hangs is known at the step it fails.

(vLLM sends the step through a shared-memory broadcast ring instead of pipes; that is the next
step for the control plane.)

Failure: a worker's death is seen from its process sentinel (waited on beside its answer), a
worker that does not answer within `tp_step_timeout` is declared hung (the collectives share the
timeout, so rank 0 cannot block in one for longer). Either makes the executor dead: this step and
every later one raise `EngineDeadError` naming the rank. `shutdown()` (also at exit) stops and
joins every worker.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import connection, get_context
from typing import NamedTuple

import numpy as np
import torch

from pagedllm.config import EngineArgs
from pagedllm.distributed import parallel_state
from pagedllm.distributed.layers import TPShard
from pagedllm.models import load_model
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.model_runner import ModelRunner

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
# seconds a worker is given to exit on its own at shutdown before it is terminated
JOIN_TIMEOUT_S = 5.0


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

    def __init__(self, rank: int, args: EngineArgs, dtype: torch.dtype, init_method: str) -> None:
        """Join the group (blocks until every rank has) and load this rank's shard."""
        self.args, self.dtype = args, dtype
        self.device = torch.device("cpu")
        self.tp = TPShard(rank, args.tensor_parallel_size)
        parallel_state.init_tensor_parallel(
            rank, self.tp.size, init_method, device=self.device, timeout_s=args.tp_step_timeout
        )
        self.model = load_model(args.model, dtype=dtype, device=self.device, tp=self.tp)
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
        )
        self.runner = ModelRunner(
            self.model, self.cache, self.device, self.lora, cpu_threads=self.args.cpu_threads
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


def _worker_main(rank: int, args: EngineArgs, dtype: torch.dtype, init_method: str, conn) -> None:
    """Rank `rank`'s process: join the group, load its shard, then run messages until told to
    stop (or the engine's end of the pipe closes). An error is sent back, then the worker exits."""
    try:
        worker = RankWorker(rank, args, dtype, init_method)
        conn.send(("loaded",))
        _, num_gpu_blocks, num_cpu_blocks = conn.recv()
        worker.allocate(num_gpu_blocks, num_cpu_blocks)
        conn.send(("ready",))
        while True:
            message = conn.recv()
            if message[0] == "shutdown":
                break
            worker.execute(*message[1:])
            conn.send(("ok",))
    except EOFError:
        pass  # the engine is gone
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        parallel_state.destroy_tensor_parallel()


class MultiprocExecutor:
    """Spawns ranks 1..N-1 and joins the group as rank 0 (in this process)."""

    def __init__(self, args: EngineArgs, dtype: torch.dtype) -> None:
        self.size = args.tensor_parallel_size
        self.timeout_s = args.tp_step_timeout
        self.shard = TPShard(0, self.size)
        self.dead: str | None = None  # why the executor can run no more steps
        init_method = parallel_state.free_init_method()
        context = get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, self.size):
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(rank, args, dtype, init_method, theirs),
                name=f"pagedllm-tp{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # so the worker's death reads as EOF here
            self.procs.append(proc)
            self.conns.append(ours)
        # at exit, even if the engine is never shut down (a weak reference: no cycle kept alive)
        ref = weakref.ref(self)
        self._atexit = lambda: (executor := ref()) is not None and executor.shutdown()
        atexit.register(self._atexit)
        try:
            self._join_group(init_method)
            self._expect("loaded")
        except BaseException:
            self.shutdown()
            raise

    def _join_group(self, init_method: str) -> None:
        """Join as rank 0 while watching the workers: one that dies before it joins fails the
        start at once, not when the rendezvous times out."""
        failed: list[BaseException] = []

        def join() -> None:
            try:
                parallel_state.init_tensor_parallel(
                    0, self.size, init_method, device=torch.device("cpu"), timeout_s=self.timeout_s
                )
            except BaseException as exc:
                failed.append(exc)

        joiner = threading.Thread(target=join, name="pagedllm-tp-join", daemon=True)
        joiner.start()
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        while joiner.is_alive():
            for sentinel in connection.wait(list(sentinels), timeout=0.05):
                self._die(self._death(sentinels[sentinel]))
        if failed:
            raise failed[0]

    def start_workers(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Give the workers the cache size rank 0 planned (every rank holds as many blocks)."""
        self._send(("cache", num_gpu_blocks, num_cpu_blocks))
        self._expect("ready")

    def runner(self, local: ModelRunner) -> ParallelModelRunner:
        return ParallelModelRunner(local, self)

    # ---- messages -----------------------------------------------------------------------------

    def _send(self, message) -> None:
        self._check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except OSError as exc:
                self._die(f"tensor-parallel rank {rank} is unreachable ({exc})")

    def _expect(self, kind: str) -> None:
        """Wait for every worker's answer `kind`; a death, an error or the timeout kills."""
        pending = dict(enumerate(self.conns, start=1))
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        while pending:
            ready = connection.wait([*pending.values(), *sentinels], timeout=self.timeout_s)
            if not ready:
                self._die(
                    f"tensor-parallel rank {min(pending)} did not answer within "
                    f"tp_step_timeout={self.timeout_s:g}s"
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
            raise EngineDeadError(self.dead)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                self._die(self._death(rank))

    def _die(self, reason: str):
        self.dead = reason
        self.shutdown()
        raise EngineDeadError(reason)

    def step(self, block_ops: list, arrays: StepArrays | None, prompt_rows) -> None:
        self._send(("step", block_ops, arrays, prompt_rows))

    def wait_step(self) -> None:
        """The workers' answers to the step. Also after rank 0's own forward failed: a collective
        that failed because a worker did is reported as that worker's failure."""
        self._check_alive()
        self._expect("ok")

    # ---- shutdown -----------------------------------------------------------------------------

    def __del__(self) -> None:
        # the engine (an `LLM`) dropped without shutdown(): its workers go with it
        if getattr(self, "procs", None):
            self.shutdown()

    def shutdown(self) -> None:
        """Stop every worker and leave the group. Idempotent. Healthy workers are asked to stop
        first; after a failure (a rank may be hung) they are killed at once."""
        atexit.unregister(self._atexit)
        healthy = self.dead is None
        for conn in self.conns if healthy else ():
            with contextlib.suppress(OSError):
                conn.send(("shutdown",))
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
        parallel_state.destroy_tensor_parallel()
        if healthy:
            self.dead = "the engine was shut down"


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
            self.executor.wait_step()
            raise
        self.executor.wait_step()
        return logits
