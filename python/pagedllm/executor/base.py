"""What the engine asks of an executor, and rank 0's runner over it.

Every rank is a `worker.Worker`; rank 0's lives in the engine process. An executor only carries
rank 0's steps to the other ranks and their answers back (`Executor`): `uniproc` (one rank:
nothing to carry), `mp` (`multiproc.MultiprocExecutor`: spawned processes, a shared-memory
ring) and `ray` (`ray_executor.RayExecutor`: actors). `ParallelModelRunner` is rank 0's runner
when there are other ranks: it sends each step, runs rank 0's forward, then collects the others'
answers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol, TypeVar

import torch

from pagedllm.config import EngineArgs
from pagedllm.distributed import parallel_state
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.worker import StepArrays, StepMessage, Worker, step_block_ops

# after rank 0's own forward failed past the step's bound, seconds still given to the other
# ranks' answers (one that failed and aborted the collective sends its error at once)
FAILED_STEP_GRACE_S = 0.5

R = TypeVar("R")  # what rank 0's part of `start_workers` returns


class Executor(Protocol):
    """Carries rank 0's steps to ranks 1..size-1 (a death, error or silence there makes it dead:
    `RankDiedError` from then on)."""

    size: int
    # why it can run no more steps (a rank died, hung or failed; it was shut down); None: it can
    dead: str | None
    # told (from another thread) of a rank's death between steps
    on_death: list[Callable[[str], None]]

    def start_workers(
        self, num_gpu_blocks: int, num_cpu_blocks: int, rank_zero: Callable[[int, int], R]
    ) -> R:
        """Every rank allocates the KV cache rank 0 planned (as many blocks on every rank): the
        other ranks are told, `rank_zero(num_gpu_blocks, num_cpu_blocks)` runs meanwhile (a
        quantized cache's calibration forward meets the other ranks' in its collectives), then
        their answers are awaited. Returns rank 0's result."""

    def broadcast_step(self, message: StepMessage) -> None:
        """Send one step to every other rank (rank 0 runs its own forward meanwhile)."""

    def collect(self, rank_zero_failed: bool = False) -> None:
        """Every other rank's answer to the step sent last. After rank 0's own forward failed
        (`rank_zero_failed`), only what is left of the step's bound is waited (at least
        `FAILED_STEP_GRACE_S`): a collective that timed out waited for a frozen rank already."""

    def check_health(self) -> None:
        """RankDiedError when the executor is dead."""

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group. Idempotent."""


class UniprocExecutor:
    """One rank, in the engine process: no other rank to carry anything to."""

    size = 1

    def __init__(self) -> None:
        self.dead: str | None = None
        self.on_death: list[Callable[[str], None]] = []

    def start_workers(
        self, num_gpu_blocks: int, num_cpu_blocks: int, rank_zero: Callable[[int, int], R]
    ) -> R:
        return rank_zero(num_gpu_blocks, num_cpu_blocks)

    def broadcast_step(self, message: StepMessage) -> None:
        pass

    def collect(self, rank_zero_failed: bool = False) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def rank_zero_runner(local: ModelRunner, executor: Executor):
    """Rank 0's runner: `local` itself with one rank, else `local` mirrored on the others."""
    return local if executor.size == 1 else ParallelModelRunner(local, executor)


def join_as_rank(
    rank: int, args: EngineArgs, dtype: torch.dtype, rendezvous: parallel_state.Rendezvous
) -> Worker:
    """Rank `rank` (1..N-1; an `mp` process, a Ray actor) joins the group at rank 0's
    `rendezvous` (blocks until every rank has), then builds its `Worker` (loads its shard)."""
    parallel_state.init_tensor_parallel(
        rank,
        args.tensor_parallel_size,
        rendezvous,
        device=torch.device("cpu"),
        timeout_s=args.tp_step_timeout,
        startup_timeout_s=args.tp_startup_timeout,
    )
    return Worker(args, rank, dtype=dtype, device=torch.device("cpu"))


def join_as_rank_zero(size: int, store, timeout_s: float, startup_timeout_s: float, watch) -> None:
    """Join the group as rank 0 on a thread while `watch()` (called every ~50 ms, it waits that
    long itself) checks the other ranks: one that fails or dies before it joins raises from
    `watch` at once, not when the rendezvous times out. The `mp` and `ray` executors start so."""
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


class ParallelInputs(NamedTuple):
    """A forward's inputs on rank 0: the arrays the other ranks get, and rank 0's own tensors
    (what `ModelRunner.prepare` returns; a rank-0-only draft model runs on these)."""

    arrays: StepArrays
    local: tuple


class ParallelModelRunner:
    """Rank 0's runner when there are other ranks: `ModelRunner`'s interface; each forward is
    sent to the other ranks (`Executor.broadcast_step`), run here, then their answers collected.

    Block operations are run here at once and sent with the next forward (the other ranks run
    them in the same order before it; nothing reads their cache in between)."""

    def __init__(self, local: ModelRunner, executor: Executor) -> None:
        self.local = local
        self.executor = executor
        self.model = local.model
        self.cache_engine = local.cache_engine
        self.device = local.device
        self.cpu_threads = local.cpu_threads
        self.cpu_isa = local.cpu_isa
        self.lora = None
        self._block_ops: list = []

    def execute_block_ops(self, step) -> None:
        self.local.execute_block_ops(step)
        ops = step_block_ops(step)
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
        rows = None if prompt is None else prompt.rows
        self.executor.broadcast_step(StepMessage(block_ops, arrays, rows))
        try:
            logits = self.local.forward(local_inputs, prompt)
        except BaseException:
            # the ranks are out of step now: RankDiedError (another rank's death, error or
            # silence), with rank 0's error as its context
            self.executor.collect(rank_zero_failed=True)
            raise
        self.executor.collect()
        return logits
